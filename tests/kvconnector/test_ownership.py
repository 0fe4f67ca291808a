"""One arena, one owner: two engines on one shm directory never share a slab, an arena's
name is never cut into another's, and what the connector cannot serve stops the engine at
start, naming the setting, instead of failing one request at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvbench import harness
from kvbench.harness import CPU, TINY, Engine
from tests.kvconnector.pairs import close
from tests.kvconnector.test_connector import prefill_and_send

shm = harness.load_connector().shm


def producer(shm_dir: Path, name: str = "gpu", **kw: Any) -> Engine:
    """A producer with a 1 MiB arena of 64 KiB slabs (16 transfers of 20 tokens)."""
    options: dict[str, Any] = {
        "device": "cpu", "backend": CPU, "num_blocks": 64, "shm_dir": shm_dir,
        "arena_mib": 1, "slab_kib": 64, "isa": "test", **kw,
    }  # fmt: skip
    engine = Engine(name, "cpu", TINY, **options)
    engine.fill(seed=hash(name) % 1000 + kw.get("dp_rank", 0))
    return engine


def consumer(shm_dir: Path, **kw: Any) -> Engine:
    engine = Engine(
        "cpu", "gpu", TINY, device="cpu", backend=CPU, num_blocks=64, shm_dir=shm_dir,
        arena_mib=0, isa="test", **kw,
    )  # fmt: skip
    engine.fill(seed=99)
    return engine


def test_a_second_engine_given_the_same_id_refuses_to_start_naming_the_first(
    shm_dir: Path,
) -> None:
    first = producer(shm_dir)
    try:
        with pytest.raises(OSError, match=r"owned by engine 'gpu', pid \d+") as refused:
            producer(shm_dir, "gpu-b", engine_id="gpu")
        assert "own engine_id" in str(refused.value)
        # The first still serves: its arena and its transfers are its own.
        assert "transfer_id" in prefill_and_send(first)[0].params
    finally:
        first.scheduler.shutdown()
        first.worker.shutdown()


def test_two_data_parallel_ranks_of_one_engine_id_never_share_a_slab(shm_dir: Path) -> None:
    """vLLM gives each data-parallel rank its own engine; the configured engine_id is the
    same for all of them. Each rank owns its arena, so their transfers never overlap."""
    rank0 = producer(shm_dir, "gpu-dp0", engine_id="gpu", dp_rank=0)
    rank1 = producer(shm_dir, "gpu-dp1", engine_id="gpu", dp_rank=1)
    decoder = consumer(shm_dir)
    try:
        names = {shm.arena_name("gpu", 0, dp_rank=0), shm.arena_name("gpu", 0, dp_rank=1)}
        assert len(names) == 2 and names <= {p.name for p in shm_dir.iterdir()}
        sent = [(rank, *prefill_and_send(rank)) for rank in (rank0, rank1) for _ in range(16)]
        for engine, prefill, blocks in sent:  # every transfer holds its own engine's KV
            decode = harness.plan_decode(decoder, prefill)
            assert decode.rid in harness.run_load(decoder, decode).finished_recving
            assert harness.same_kv(engine, blocks, decoder, decode, 20)
            decoder.release(decode.rid)
    finally:
        for engine in (rank0, rank1, decoder):
            engine.scheduler.shutdown()
            engine.worker.shutdown()


def test_arena_names_carry_the_ranks_and_are_never_cut_into_one() -> None:
    long = "deployment-" + "x" * 120
    names = {
        shm.arena_name(long + "a", 0),
        shm.arena_name(long + "b", 0),
        shm.arena_name("gpu/a", 0),
        shm.arena_name("gpu_a", 0),
        shm.arena_name("gpu", 0, dp_rank=1),
        shm.arena_name("gpu", 0, pp_rank=1),
        shm.arena_name("gpu", 1),
        shm.arena_name("gpu", 0),
    }
    assert len(names) == 8
    assert all(shm.ARENA_RE.fullmatch(n) for n in names)
    assert "-dp1-" in shm.arena_name("gpu", 0, dp_rank=1)


@pytest.mark.parametrize(
    "change,setting",
    [
        ({"parallel": {"pipeline_parallel_size": 2}}, "pipeline_parallel_size 2"),
        ({"parallel": {"decode_context_parallel_size": 2}}, "decode_context_parallel_size 2"),
        ({"parallel": {"tensor_parallel_size": 4}}, "tensor_parallel_size 4 over the model's 2"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype 'fp8_e4m3'"),
        ({"parallel": {"tensor_parallel_size": 2}, "arena_mib": 0}, "tensor_parallel_size 1"),
        ({"backend": "FlashInferImpl"}, "attention backend 'FlashInferImpl'"),
    ],
    ids=["pipeline", "decode-context", "tp-wider-than-heads", "fp8", "consumer-tp", "flashinfer"],
)
def test_what_the_connector_cannot_serve_stops_the_engine_at_start_naming_it(
    shm_dir: Path, change: dict[str, Any], setting: str
) -> None:
    with pytest.raises(ValueError, match=setting):
        engine = producer(shm_dir, **change)
        close((engine,))  # type: ignore[arg-type]


def test_the_arena_of_a_crashed_owner_is_taken_over_by_its_restart(shm_dir: Path) -> None:
    first = producer(shm_dir)
    close((first,), crash=True)  # type: ignore[arg-type]
    restarted = producer(shm_dir)
    try:
        owner = shm.arena.read_owner(str(shm_dir / shm.arena_name("gpu", 0)))
        assert owner is not None and owner["engine_id"] == "gpu" and owner["ready"] is True
    finally:
        close((restarted,))  # type: ignore[arg-type]
