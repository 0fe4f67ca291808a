"""Saves as a GPU engine's steps make them: several prefills finishing in one step, a
one-token last chunk inside a uniform-decode step (a full CUDA graph: no ``save_kv_layer``),
and a draft model's layers beside the target's. Every stored prefill is saved in the step
that finishes it, gathered in ``wait_for_save``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench import harness
from kvbench.harness import CPU, FLASH, TINY, Engine
from tests.kvconnector.pairs import close


def pair(shm_dir: Path, backend: str, *, draft_layers: int = 0) -> tuple[Engine, Engine]:
    """A producer with a 4 MiB arena of 64 KiB slabs (64 transfers of 20 tokens)."""
    producer = Engine(
        "gpu", "cpu", TINY, device="cpu", backend=backend, num_blocks=160, shm_dir=shm_dir,
        arena_mib=4, slab_kib=64, isa="test", draft_layers=draft_layers,
    )  # fmt: skip
    consumer = Engine(
        "cpu", "gpu", TINY, device="cpu", backend=backend, num_blocks=160, shm_dir=shm_dir,
        arena_mib=0, isa="test",
    )  # fmt: skip
    producer.fill(seed=1)
    consumer.fill(seed=2)
    return producer, consumer


def all_loaded(producer: Engine, consumer: Engine, prefills: list[harness.Prefill]) -> None:
    blocks = {p.rid: list(producer.request_blocks[p.rid]) for p in prefills}
    for p in prefills:
        harness.finish_prefill(producer, p)
    assert harness.poll_sent(producer) == {p.rid for p in prefills}
    for p in prefills:
        assert p.params is not None and "transfer_id" in p.params, p.params
        decode = harness.plan_decode(consumer, p)
        results = harness.run_load(consumer, decode)
        assert decode.rid in results.finished_recving and not results.failed_recving
        assert harness.same_kv(producer, blocks[p.rid], consumer, decode, len(p.prompt))
        consumer.release(decode.rid)


@pytest.mark.parametrize("backend", [CPU, FLASH])
@pytest.mark.parametrize("count", [1, 16, 64])
def test_prefills_finishing_together_are_saved_in_their_step(
    shm_dir: Path, backend: str, count: int
) -> None:
    producer, consumer = pair(shm_dir, backend)
    try:
        prefills = harness.plan_together(producer, count, 20)
        assert len(prefills[0].meta.stores) == count
        with producer.step(prefills[0].meta):
            harness.save_layers(producer)
        all_loaded(producer, consumer, prefills)
    finally:
        close((producer, consumer))


@pytest.mark.parametrize("backend", [CPU, FLASH])
def test_a_one_token_last_chunk_in_a_uniform_decode_step_is_saved(
    shm_dir: Path, backend: str
) -> None:
    """vLLM replays a full CUDA graph when every request has one token scheduled: no
    ``save_kv_layer`` runs in that step, yet it finishes these prefills."""
    producer, consumer = pair(shm_dir, backend)
    try:
        prefills = harness.plan_together(producer, 16, 33, last_chunk=1)  # (33 - 1) % 16 == 0
        with producer.step(prefills[0].meta):
            pass  # the graph replays: no save_kv_layer
        all_loaded(producer, consumer, prefills)
    finally:
        close((producer, consumer))


def test_a_draft_model_s_layers_are_saved_in_the_same_step(shm_dir: Path) -> None:
    """EAGLE's draft layers are in the producer's KV cache and run after the target's; the
    segment holds them too, and a consumer without a draft model loads the target's."""
    producer, consumer = pair(shm_dir, FLASH, draft_layers=1)
    try:
        prefills = harness.plan_together(producer, 4, 20)
        with producer.step(prefills[0].meta):
            harness.save_layers(producer)  # the target's layers; the draft's in its graph
        harness.finish_prefill(producer, prefills[0])
        harness.poll_sent(producer)
        shm = producer.module.shm
        header = shm.read_header(str(shm_dir / prefills[0].params["segment"]))
        assert "error" not in header and set(header["layers"]) == set(producer.all_layers)
        all_loaded(producer, consumer, prefills[1:])
    finally:
        close((producer, consumer))


def test_a_gather_is_one_per_layer_and_step_not_per_request(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-token KV (a CUDA backend's): 16 prefills finishing together are gathered with one
    index per layer, not one per request and layer."""
    producer, consumer = pair(shm_dir, FLASH)
    try:
        prefills = harness.plan_together(producer, 16, 20)
        calls: list[int] = []
        saver = producer.worker._copier.saver
        index = saver._index

        def counted(batch: list[object], device: object) -> object:
            calls.append(len(batch))
            return index(batch, device)

        monkeypatch.setattr(saver, "_index", counted)
        with producer.step(prefills[0].meta):
            harness.save_layers(producer)
        assert calls == [16]  # one index for the step; one gather per layer over it
        all_loaded(producer, consumer, prefills)
    finally:
        close((producer, consumer))
