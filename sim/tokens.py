"""The simulator's tokenizer and its "model": both deterministic functions, no randomness.

Token ids ``0 .. VOCABULARY_SIZE - 1`` are the generated vocabulary: fixed lower-case ASCII
words that decode to ``" word"`` (leading space, no JSON escaping needed). Tokenising text
splits it on whitespace; a word of that vocabulary maps to its id (so generated text
re-tokenises to exactly the ids that produced it), any other word to a stable hash in
``[VOCABULARY_SIZE, vocab_size - SPECIAL_TOKENS)``. The top ``SPECIAL_TOKENS`` ids are the
chat template's markers.

A chat prompt is, per message, ``<start> role <newline> content... <end>`` (content words + 4)
and then ``<start> assistant <newline>`` for the reply header (3), so a reply sent back as an
assistant message continues the ids its header began, as real chat templates do (and a
follow-up turn finds the earlier turn's reply in the prefix cache).

Decoding (``/detokenize``) gives a vocabulary id its word; any other id (a prompt word, which
a hash cannot give back, or a chat marker) becomes the placeholder word ``<|id|>``, which
tokenises back to that id. So text and ids convert both ways without loss.

Generation is greedy decoding of a function of the context: the next token id is a hash of
the engine seed (the "weights"), the last ``CONTEXT_WINDOW`` token ids and the position. So a
prompt given as token ids continues exactly where an uninterrupted request would have, on
any engine with the same seed, whether its KV was computed, handed over or recomputed.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from collections.abc import Iterable, Sequence

VOCABULARY_SIZE = 4096
SPECIAL_TOKENS = 8
CONTEXT_WINDOW = 4  # how many trailing token ids the next token depends on (plus position)
# A sequence without max_tokens (and without ignore_eos) ends by itself: each generated token
# is the end with probability 1 / MEAN_NATURAL_LENGTH, a geometric length of mean ~200.
MEAN_NATURAL_LENGTH = 200
_VOCABULARY_SEED = 0  # the tokenizer is part of the model: the same on every engine
_MASK = (1 << 64) - 1
_SYLLABLES = [
    "ka",
    "ri",
    "to",
    "mu",
    "sen",
    "la",
    "vo",
    "pi",
    "del",
    "an",
    "or",
    "es",
    "ul",
    "ti",
    "ne",
    "ba",
    "go",
    "hu",
    "ze",
    "qua",
    "ro",
    "mi",
    "fa",
    "lu",
]


def build_vocabulary(size: int = VOCABULARY_SIZE) -> list[str]:
    """``size`` distinct pre-spaced tokens (" word"), always the same."""
    rng = random.Random(_VOCABULARY_SEED)
    words: set[str] = set()
    vocabulary: list[str] = []
    while len(vocabulary) < size:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        if word not in words:
            words.add(word)
            vocabulary.append(" " + word)
    return vocabulary


VOCABULARY: list[str] = build_vocabulary()
VOCABULARY_BYTES: list[bytes] = [w.encode() for w in VOCABULARY]
_WORD_IDS: dict[str, int] = {w[1:]: i for i, w in enumerate(VOCABULARY)}
_ID_WORD = re.compile(r"<\|(\d{1,9})\|>")  # the placeholder of an id without a word


class Tokenizer:
    """Text <-> token ids for one model's vocabulary size."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= VOCABULARY_SIZE + SPECIAL_TOKENS:
            raise ValueError(f"vocab_size {vocab_size} leaves no room for prompt words")
        self.vocab_size = vocab_size
        self.start_id = vocab_size - 1
        self.end_id = vocab_size - 2
        self.newline_id = vocab_size - 3
        self._hash_span = vocab_size - SPECIAL_TOKENS - VOCABULARY_SIZE
        self._word_id = functools.lru_cache(maxsize=1 << 16)(self._hash_word)

    def _hash_word(self, word: str) -> int:
        known = _WORD_IDS.get(word)
        if known is not None:
            return known
        placeholder = _ID_WORD.fullmatch(word)
        if placeholder is not None and int(placeholder[1]) < self.vocab_size:
            return int(placeholder[1])
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        return VOCABULARY_SIZE + int.from_bytes(digest, "big") % self._hash_span

    def encode(self, text: str) -> list[int]:
        word_id = self._word_id
        return [word_id(w) for w in text.split()]

    def encode_chat(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """(role, content) pairs through the chat template: with the reply header (as a
        chat completion renders it), or with the last message left open to be continued."""
        ids: list[int] = []
        for i, (role, content) in enumerate(messages):
            ids += [self.start_id, self._word_id(role), self.newline_id]
            ids.extend(self.encode(content))
            if not (continue_final_message and i == len(messages) - 1):
                ids.append(self.end_id)
        if add_generation_prompt:
            ids += [self.start_id, self._word_id("assistant"), self.newline_id]
        return ids

    def token_text(self, token_id: int) -> str:
        """What one token id decodes to: its word, the placeholder of an id without one, or
        nothing for an id past the vocabulary (as a real tokenizer decodes one)."""
        if 0 <= token_id < VOCABULARY_SIZE:
            return VOCABULARY[token_id]
        return f" <|{token_id}|>" if 0 <= token_id < self.vocab_size else ""

    def decode(self, token_ids: Iterable[int]) -> str:
        """The text of token ids; the text of ids below vocab_size tokenises back to them."""
        return "".join(self.token_text(t) for t in token_ids)


def decode(token_ids: Iterable[int]) -> str:
    """The text of generated token ids (every one is below VOCABULARY_SIZE)."""
    return "".join(VOCABULARY[t] for t in token_ids)


class TokenModel:
    """Greedy "decoding": a pure function of (seed, last token ids, position)."""

    __slots__ = ("_salt",)

    def __init__(self, seed: int) -> None:
        self._salt = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK

    def sample(self, tail: Sequence[int], position: int) -> tuple[int, bool]:
        """(next token id, whether it ends the sequence naturally) at ``position``."""
        h = (self._salt ^ (position * 0xD6E8FEB86659FD93)) & _MASK
        for token in tail:
            h = ((h ^ token) * 0xBF58476D1CE4E5B9) & _MASK
            h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK
        h ^= h >> 29
        return h % VOCABULARY_SIZE, (h >> 32) % MEAN_NATURAL_LENGTH == 0


def context_tail(token_ids: Sequence[int]) -> list[int]:
    """The part of a context the next token depends on."""
    return list(token_ids[-CONTEXT_WINDOW:])
