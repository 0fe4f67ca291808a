"""Which replica was last sent which prompt prefix: the approximate index the prefix-aware
replica choice reads (``router.decide.pipeline.REPLICA``, step ``prefix``).

The router does not tokenize, so a prompt is cut into chunks of ``CHUNK_CHARS`` characters of
its text (a chat's messages as role and content, a prompt of token ids as ``CHUNK_IDS`` ids a
chunk), each named by a hash chained over every chunk before it, as an engine names its KV
blocks: equal hashes mean equal prefixes. Sending a request to a replica records its chunks
there; a later prompt matches a replica by how many of its leading chunks that replica was sent.

What the engines really hold is not known here (an engine evicts under KV pressure; a restart
loses all), so the index is bounded: at most ``capacity`` chunks, the least recently sent or
matched forgotten first, and a replica that leaves the deployment set is forgotten at once.
A match is a hint weighed against load, never a promise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

CHUNK_CHARS = 256  # about 64 tokens at the four characters a token the limits estimate with
CHARS_PER_TOKEN = 4
CHUNK_IDS = 64  # a prompt given as token ids
DEFAULT_CAPACITY = 65536  # chunks: ~4M prompt tokens remembered, a few tens of MB at most
# The most chunks one prompt is cut into (~64k tokens): a body near the size limit costs a
# bounded hashing and cannot flush everyone else's prefixes out of the index.
MAX_PROMPT_CHUNKS = 1024
_ROOT = 0


def _text_of(body: dict[str, Any]) -> str | list[int] | None:
    """The prompt of a chat or completion body as text (or token ids); None where it has
    none the index can use (a batch of prompts, a malformed body)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            if isinstance(content, list):  # text parts; other parts have no text to match
                content = "".join(
                    p.get("text", "") for p in content if isinstance(p, dict) and p.get("text")
                )
            text = content if isinstance(content, str) else ""
            parts.append(f"{message.get('role')}\x1f{text}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def prompt_chunks(body: dict[str, Any]) -> tuple[int, ...]:
    """The chained hashes of the whole chunks of ``body``'s prompt (none: nothing to match)."""
    text = _text_of(body)
    if not text:
        return ()
    size = CHUNK_IDS if isinstance(text, list) else CHUNK_CHARS
    hashes: list[int] = []
    parent = _ROOT
    for start in range(0, min(len(text) - size + 1, MAX_PROMPT_CHUNKS * size), size):
        piece = text[start : start + size]
        parent = hash((parent, piece if isinstance(piece, str) else tuple(piece)))
        hashes.append(parent)
    return tuple(hashes)


def chunk_tokens(chunks: int, body: dict[str, Any]) -> int:
    """About how many prompt tokens ``chunks`` leading chunks of ``body`` hold."""
    if isinstance(body.get("prompt"), list):
        return chunks * CHUNK_IDS
    return chunks * CHUNK_CHARS // CHARS_PER_TOKEN


class PrefixIndex:
    """Chunk hash -> the replicas (deployment ids) sent it, least recently used first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"prefix index capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._chunks: OrderedDict[int, set[int]] = OrderedDict()
        self._replicas: set[int] = set()  # every replica some chunk was recorded for
        self.forgotten_total = 0  # chunks dropped for room

    def __len__(self) -> int:
        return len(self._chunks)

    def match(self, chunks: Sequence[int], replicas: Sequence[int]) -> list[int]:
        """For each of ``replicas``, how many leading ``chunks`` it was sent."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        index = self._chunks
        for depth, chunk in enumerate(chunks):
            holders = index.get(chunk)
            if holders is None:
                break
            present = alive & holders
            if not present:
                break
            index.move_to_end(chunk)
            for replica in present:
                matched[replica] = depth + 1
            alive = present
        return [matched[r] for r in replicas]

    def record(self, chunks: Iterable[int], replica: int) -> None:
        """``replica`` was sent a prompt of ``chunks``."""
        self._replicas.add(replica)
        index = self._chunks
        for chunk in chunks:
            holders = index.get(chunk)
            if holders is None:
                index[chunk] = {replica}
            else:
                holders.add(replica)
                index.move_to_end(chunk)
        while len(index) > self.capacity:
            index.popitem(last=False)
            self.forgotten_total += 1

    def keep_only(self, replicas: Iterable[int]) -> None:
        """Forget every replica not in ``replicas`` (it left the deployment set)."""
        self._drop(self._replicas - set(replicas))

    def forget(self, replica: int) -> None:
        """Forget ``replica`` everywhere: its engine says it holds nothing (its KV events:
        ``router.kv_events``)."""
        self._drop({replica})

    def _drop(self, leaving: set[int]) -> None:
        """Take ``leaving`` out of every chunk, and the chunks left with no replica. A
        deployment update that removes nobody costs nothing."""
        leaving &= self._replicas
        if not leaving:
            return
        self._replicas -= leaving
        for chunk in [c for c, holders in self._chunks.items() if holders & leaving]:
            holders = self._chunks[chunk] - leaving
            if holders:
                self._chunks[chunk] = holders
            else:
                del self._chunks[chunk]
