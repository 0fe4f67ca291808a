"""Deterministic tokenisation of the simulator.

One token per whitespace-separated word. Generated tokens are " word" (leading space) drawn
from a seeded vocabulary of lower-case ASCII words, so a text of k generated tokens splits
back into exactly k tokens and needs no JSON escaping. A chat prompt counts the words of every
message's content plus ``CHAT_TOKENS_PER_MESSAGE`` per message (role and separators of a chat
template) plus ``CHAT_TOKENS_REPLY_PRIMER`` for the assistant header the template appends.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable

CHAT_TOKENS_PER_MESSAGE = 3
CHAT_TOKENS_REPLY_PRIMER = 3
VOCABULARY_SIZE = 4096
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


def count_words(text: str) -> int:
    return len(text.split())


def chat_prompt_tokens(contents: Iterable[str]) -> int:
    count = CHAT_TOKENS_REPLY_PRIMER
    for content in contents:
        count += CHAT_TOKENS_PER_MESSAGE + count_words(content)
    return count


def build_vocabulary(seed: int, size: int = VOCABULARY_SIZE) -> list[str]:
    """``size`` distinct pre-spaced tokens (" word"), the same for the same seed."""
    rng = random.Random(seed)
    words: set[str] = set()
    vocabulary: list[str] = []
    while len(vocabulary) < size:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        if word not in words:
            words.add(word)
            vocabulary.append(" " + word)
    return vocabulary


def request_rng(seed: int, key: str) -> random.Random:
    """A generator for one request's tokens: fixed by the engine seed and the prompt."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def natural_length(rng: random.Random, limit: int) -> int:
    """Where a sequence without max_tokens stops by itself (an end-of-sequence token).

    Geometric-like with a mean of about 200 tokens, at least 1, at most ``limit``.
    """
    length = 1 + int(rng.expovariate(1 / 200))
    return max(1, min(length, limit))
