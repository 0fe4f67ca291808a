"""The simulator's prefix cache (sim/prefix_cache.py): hashes, hits, shared blocks, LRU
eviction under KV pressure, and what the server reports of it (metrics, cached_tokens)."""

from __future__ import annotations

import random

from common.presets import device_preset, model_preset
from sim.perfmodel import effective_hardware
from sim.prefix_cache import BlockHasher, PrefixCache, chain_hashes
from sim.scheduler import BatchScheduler, SchedulerConfig, Sequence
from sim.tokens import Tokenizer, TokenModel, decode

MODEL = "qwen2.5-7b-instruct"
BLOCK = 16


def scheduler(*, num_blocks: int = 1000, caching: bool = True, swap: int = 0) -> BatchScheduler:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=8192,
        num_blocks=num_blocks,
        num_swap_blocks=swap,
        block_size=BLOCK,
        watermark=0.0,
        prefix_caching=caching,
        preemption_mode="swap" if swap else "recompute",
    )
    device = device_preset("a10-24gb")
    hw = effective_hardware(device)
    return BatchScheduler(config, hw, model_preset(MODEL), TokenModel(0), 1e9)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def seq(name: str, prompt: list[int], new: int = 1) -> Sequence:
    return Sequence(name, len(prompt), new, tail=prompt[-4:], hasher=BlockHasher(prompt, BLOCK))


def run(sched: BatchScheduler, now: float = 0.0) -> tuple[float, int]:
    """Run to idle; returns (the time it ended, prefill tokens computed)."""
    prefilled = 0
    while sched.has_work():
        step = sched.plan(now)
        assert step is not None
        now += step.duration
        prefilled += step.prefill_tokens
        sched.complete(step, now)
    return now, prefilled


def test_equal_prefixes_hash_equal_and_a_change_breaks_the_chain_from_its_block_on() -> None:
    a = ids(64, 1)
    b = [*a[:40], 7, *a[41:]]
    ha, hb = chain_hashes(a, BLOCK), chain_hashes(b, BLOCK)
    assert len(ha) == 4
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]  # the chain: block 3 equal, yet its hash differs
    assert chain_hashes(a[:63], BLOCK) == ha[:3]  # no hash for a partial block
    grown = BlockHasher(a[:50], BLOCK)
    for token in a[50:]:
        grown.append(token)
    assert grown.hashes == ha


def test_a_repeated_prompt_skips_its_cached_blocks_but_never_its_last_token() -> None:
    sched = scheduler()
    prompt = ids(64, 2)
    sched.add(seq("first", prompt))
    _, first = run(sched)
    assert first == 64
    again = seq("again", prompt)
    sched.add(again)
    _, second = run(sched)
    # 64 tokens: at most 63 may hit, so 3 whole blocks, and the last block is computed.
    assert again.cache_hits == 48 and second == 16
    longer = seq("longer", prompt + ids(20, 3))
    sched.add(longer)
    _, third = run(sched)
    assert longer.cache_hits == 64 and third == 20


def test_without_caching_nothing_is_looked_up() -> None:
    sched = scheduler(caching=False)
    prompt = ids(64, 2)
    for name in ("a", "b"):
        s = seq(name, prompt)
        sched.add(s)
        _, prefilled = run(sched)
        assert prefilled == 64 and s.cache_hits == 0


def test_generated_tokens_are_cached_too_so_a_follow_up_turn_hits_them() -> None:
    sched = scheduler()
    prompt = ids(40, 4)
    first = seq("turn1", prompt, new=40)
    sched.add(first)
    run(sched)
    reply = first.hasher.hashes if first.hasher else []
    assert len(reply) == 5  # 80 ids known: 40 prompt + 40 generated
    # The next turn's prompt carries the reply: the blocks computed (79 tokens) hit.
    history = prompt + [0] * 40  # the ids do not matter to the cache, only their hashes
    follow = Sequence("turn2", 100, 1, hasher=BlockHasher(history + ids(20, 5), BLOCK))
    follow.hasher.hashes[:4] = reply[:4]  # type: ignore[union-attr]
    sched.add(follow)
    run(sched)
    assert follow.cache_hits == 64  # 4 blocks computed in full (79 // 16), the 5th was not


def test_sequences_sharing_a_prefix_hold_its_blocks_once() -> None:
    sched = scheduler(num_blocks=100)
    shared = ids(64, 6)
    sched.add(seq("a", shared + ids(16, 7), new=50))
    step = sched.plan(0.0)
    assert step is not None
    sched.complete(step, step.duration)
    used_by_a = 100 - sched.free_blocks
    sched.add(seq("b", shared + ids(16, 8), new=50))
    step = sched.plan(1.0)
    assert step is not None
    b = next(s for s, _ in step.scheduled if s.request_id == "b")
    assert b.cache_hits == 64
    # b's 4 shared blocks are a's: b takes only its own (one prompt block + one for decode).
    assert 100 - sched.free_blocks == used_by_a + 2
    sched.complete(step, 2.0)
    run(sched, 2.0)
    assert sched.free_blocks == 100  # all given back, cached ones counted free
    assert sched.cache is not None and sched.cache.free_cached > 0


def test_cached_blocks_are_evicted_least_recently_freed_first_when_room_is_needed() -> None:
    sched = scheduler(num_blocks=12)
    cache = sched.cache
    assert cache is not None
    old, recent = ids(64, 9), ids(64, 10)
    for name, prompt in (("old", old), ("recent", recent)):
        sched.add(seq(name, prompt))
        run(sched)
    assert cache.free_cached == 8 and sched.free_blocks == 12
    # A prompt of 10 blocks needs the room of 6 cached blocks: the older prompt's go first,
    # then the recent one's from its end, so its first blocks stay.
    sched.add(seq("big", ids(160, 11)))
    run(sched)
    assert cache.evictions_total == 6
    probe_old, probe_recent = seq("o", old), seq("r", recent)
    assert cache.lookup(probe_old.hasher.hashes, 4) == 0  # type: ignore[union-attr]
    assert cache.lookup(probe_recent.hasher.hashes, 4) == 2  # type: ignore[union-attr]
    assert sched.free_blocks == 12 and cache.free_cached <= sched.free_blocks


def test_a_recomputed_sequence_hits_its_own_blocks_and_swap_keeps_the_counts_whole() -> None:
    for swap in (0, 64):
        sched = scheduler(num_blocks=14, swap=swap)
        a = seq("a", ids(96, 12), new=60)
        sched.add(a)
        step = sched.plan(0.0)
        assert step is not None
        sched.complete(step, step.duration)
        # Both grow past the 14 blocks: one is preempted (recomputed or swapped) for the other.
        b = seq("b", ids(96, 13), new=60)
        sched.add(b)
        run(sched, step.duration)
        assert a.preemptions + b.preemptions >= 1, swap
        assert a.generated == b.generated == 60
        assert sched.free_blocks == 14 and sched.free_swap_blocks == swap, swap
        assert sched.cache is not None and sched.cache.free_cached <= 14


def test_the_cache_records_block_events_when_asked() -> None:
    cache = PrefixCache(BLOCK, record_events=True)
    tokens = ids(48, 14)
    hashes = chain_hashes(tokens, BLOCK)
    parents = [None, *hashes[:-1]]
    for i, (h, parent) in enumerate(zip(hashes, parents, strict=True)):
        assert cache.register(h, parent, tokens[i * BLOCK : (i + 1) * BLOCK])
    assert not cache.register(hashes[0])  # already cached: no second event
    assert cache.release(hashes) == 3
    cache.evict_to(1)
    # One run of blocks is one stored event, with the parent before it and all its tokens.
    assert cache.take_events() == [
        ("stored", hashes, None, tokens),
        ("removed", [hashes[2], hashes[1]], None, []),
    ]
    assert cache.take_events() == []


def test_a_run_that_does_not_continue_the_last_one_is_its_own_event() -> None:
    cache = PrefixCache(BLOCK, record_events=True)
    first, other = chain_hashes(ids(32, 1), BLOCK), chain_hashes(ids(16, 2), BLOCK)
    cache.register(first[0], None, [1] * BLOCK)
    cache.register(other[0], None, [2] * BLOCK)  # another context's first block
    cache.register(first[1], first[0], [3] * BLOCK)  # the first context again
    assert [(kind, len(h), parent) for kind, h, parent, _ in cache.events] == [
        ("stored", 1, None),
        ("stored", 1, None),
        ("stored", 1, first[0]),
    ]


def test_a_reply_sent_back_continues_the_ids_its_header_began() -> None:
    """The chat template: a follow-up turn's prompt starts with the earlier prompt and its
    reply's ids, so the prefix cache finds the reply too."""
    tokenizer = Tokenizer(152064)
    first = tokenizer.encode_chat([("system", "be brief"), ("user", "hi there")])
    reply = [5, 6, 7, 8]
    second = tokenizer.encode_chat(
        [("system", "be brief"), ("user", "hi there"), ("assistant", decode(reply)),
         ("user", "more")]
    )  # fmt: skip
    assert second[: len(first) + len(reply)] == first + reply
