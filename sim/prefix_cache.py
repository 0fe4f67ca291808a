"""vLLM's automatic prefix caching, as the batch scheduler needs it: block hashes and counts.

A full block of a context (``block_size`` token ids) is named by a hash chained over every
block before it, so equal hashes mean equal prefixes. A block whose KV is computed is
registered under its hash. Running sequences hold references to the registered blocks they
use; a block nobody holds stays cached but counts as free, and is evicted, least recently
freed first, when an allocation needs its room - as vLLM's free block queue does. A new
sequence is looked up before it is admitted: its leading blocks found in the cache are not
prefilled again (never the whole prompt: the last token is always computed, for its logits).

Only counts and hashes are kept; the scheduler's ``free_blocks`` stays the one number of
blocks no sequence holds, cached ones included, so ``vllm:kv_cache_usage_perc`` reads the
same with caching on or off. ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` events, as
vLLM publishes them (``--kv-events-config``), are collected for whoever drains ``events``
(sim/kv_events.py sends them): a run of blocks one sequence computed is one stored event with
the hash of the block before it and the run's token ids, as vLLM's ``cache_full_blocks`` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# The hash of the (absent) block before a context's first one.
ROOT_HASH = 0


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (a trailing partial block has
    none), each continuing from ``parent``."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class BlockHasher:
    """A sequence's block hashes, extended a token at a time as it generates. With
    ``keep_tokens`` it also keeps every token id (what a ``BlockStored`` event names)."""

    __slots__ = ("_partial", "block_size", "hashes", "tokens")

    def __init__(
        self, token_ids: Sequence[int], block_size: int, *, keep_tokens: bool = False
    ) -> None:
        self.block_size = block_size
        self.hashes = chain_hashes(token_ids, block_size)
        self._partial = list(token_ids[len(self.hashes) * block_size :])
        self.tokens: list[int] | None = list(token_ids) if keep_tokens else None

    def block_tokens(self, index: int) -> Sequence[int]:
        """The token ids of full block ``index`` (none unless ``keep_tokens``)."""
        if self.tokens is None:
            return ()
        return self.tokens[index * self.block_size : (index + 1) * self.block_size]

    def append(self, token_id: int) -> None:
        if self.tokens is not None:
            self.tokens.append(token_id)
        self._partial.append(token_id)
        if len(self._partial) == self.block_size:
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.append(hash((parent, tuple(self._partial))))
            self._partial.clear()


class PrefixCache:
    """Registered blocks by hash: how many running sequences hold each, and those nobody
    holds in eviction order (least recently freed first)."""

    def __init__(self, block_size: int, *, record_events: bool = False) -> None:
        self.block_size = block_size
        self._held: dict[int, int] = {}  # hash -> holders (at least 1)
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, held by none
        self.evictions_total = 0
        self.record_events = record_events
        # (kind, hashes, parent hash, token ids) in the order they happened: kind "stored"
        # (a run of blocks, the hash before the first: None at a context's start), "removed"
        # or "cleared" (sim/kv_events.py ``RecordedEvent``).
        self.events: list[tuple[str, list[int], int | None, list[int]]] = []

    def __len__(self) -> int:
        return len(self._held) + len(self._free)

    @property
    def free_cached(self) -> int:
        """Cached blocks nobody holds (part of the scheduler's free blocks)."""
        return len(self._free)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._held or block_hash in self._free

    def free_among(self, hashes: Iterable[int]) -> int:
        """How many of the cached ``hashes`` nobody holds (holding them takes their room)."""
        return sum(1 for block_hash in hashes if block_hash in self._free)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many of the leading ``hashes`` (at most ``max_blocks``) are cached."""
        found = 0
        for block_hash in hashes[:max_blocks]:
            if block_hash not in self._held and block_hash not in self._free:
                break
            found += 1
        return found

    def acquire(self, hashes: Iterable[int]) -> int:
        """Hold the cached blocks ``hashes`` (all cached: ``lookup`` found them); returns how
        many were free, which the caller takes out of its free count."""
        taken = 0
        for block_hash in hashes:
            if block_hash in self._free:
                del self._free[block_hash]
                self._held[block_hash] = 1
                taken += 1
            else:
                self._held[block_hash] += 1
        return taken

    def register(
        self, block_hash: int, parent: int | None = None, tokens: Sequence[int] = ()
    ) -> bool:
        """A block just computed, held by the sequence that computed it (``parent``: the hash
        of the block before it, None for a context's first; ``tokens``: its ids, for the
        event). False where that hash is cached already (the sequence keeps its copy
        private, as vLLM does)."""
        if block_hash in self._held or block_hash in self._free:
            return False
        self._held[block_hash] = 1
        if self.record_events:
            last = self.events[-1] if self.events else None
            if last is not None and last[0] == "stored" and last[1][-1] == parent:
                last[1].append(block_hash)  # the run goes on
                last[3].extend(tokens)
            else:
                self.events.append(("stored", [block_hash], parent, list(tokens)))
        return True

    def release(self, hashes: Iterable[int]) -> int:
        """Drop one hold on each of ``hashes``; returns how many nobody holds now (the
        caller adds them back to its free count, still cached)."""
        freed = 0
        # The sequence's last blocks are the first to go, as vLLM frees a request's blocks.
        for block_hash in reversed(list(hashes)):
            holders = self._held[block_hash] - 1
            if holders:
                self._held[block_hash] = holders
                continue
            del self._held[block_hash]
            self._free[block_hash] = None
            freed += 1
        return freed

    def evict_to(self, free_blocks: int) -> None:
        """Forget the least recently freed cached blocks until no more are cached than the
        ``free_blocks`` left (an allocation has taken the room of the others)."""
        while len(self._free) > max(0, free_blocks):
            block_hash, _ = self._free.popitem(last=False)
            self.evictions_total += 1
            if self.record_events:
                last = self.events[-1] if self.events else None
                if last is not None and last[0] == "removed":
                    last[1].append(block_hash)
                else:
                    self.events.append(("removed", [block_hash], None, []))

    def clear(self) -> int:
        """Forget every cached block nobody holds (vLLM's ``/reset_prefix_cache``)."""
        dropped = len(self._free)
        if self.record_events and dropped:
            self.events.append(("removed", list(self._free), None, []))
        self._free.clear()
        return dropped

    def take_events(self) -> list[tuple[str, list[int], int | None, list[int]]]:
        """The events recorded since the last call, oldest first."""
        events, self.events = self.events, []
        return events
