"""What a hostile client (or a broken peer) can send the connector, and what it gets: every
field of ``kv_transfer_params`` checked with a named cause, every hook that handles one
request's transfer turning an exception into that request's fallback or recompute, and no
way to hold the arena or ``/dev/shm`` past its configured size or a lease past its
configured length. An exception that means the engine itself is broken still goes through.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbench import harness
from kvbench.harness import Engine
from tests.kvconnector.pairs import close, make_pair
from tests.kvconnector.test_connector import TINY_GEOMETRY, prefill_and_send, segment_files

shm = harness.load_connector().shm
LEASE = 30.0
GOOD = {
    "transfer_id": "0123456789abcdef" * 2,
    "num_tokens": 20,
    "ranks": 1,
    "producer_engine_id": "gpu",
    "ipc_namespace": "ipc:[1]",
    "geometry": TINY_GEOMETRY,
}


def check(change: dict[str, Any], **limits: Any) -> Any:
    """The consumer's checks of ``GOOD`` (a lease ten seconds away) with ``change``."""
    params = {**GOOD, "lease_expires_at": int(time.time()) + 10, **change}
    return shm.check_params(
        params,
        engine_id="cpu",
        peer_engine_id="gpu",
        ipc_ns="ipc:[1]",
        geometry=TINY_GEOMETRY,
        tensor_parallel=1,
        prompt_tokens=21,
        **limits,
    )


HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "lease NaN": ({"lease_expires_at": math.nan}, "is not a time"),
    "lease inf": ({"lease_expires_at": math.inf}, "is not a time"),
    "lease 1e999 in JSON": (json.loads('{"lease_expires_at": 1e999}'), "is not a time"),
    "lease -Infinity in JSON": (json.loads('{"lease_expires_at": -Infinity}'), "is not a time"),
    "lease an integer past any float": ({"lease_expires_at": 10**400}, "is not a time"),
    "lease the string nan": ({"lease_expires_at": "nan"}, "is not a number"),
    "lease negative": ({"lease_expires_at": -1}, "is not a time"),
    "lease zero": ({"lease_expires_at": 0}, "is not a time"),
    "lease a bool": ({"lease_expires_at": True}, "is not a number"),
    "ranks zero": ({"ranks": 0}, "ranks 0 is not in [1, 2]"),
    "ranks past the heads": ({"ranks": 3}, "ranks 3 is not in [1, 2]"),
    "ranks negative": ({"ranks": -2}, "ranks -2 is not in"),
    "ranks a string": ({"ranks": "1"}, "ranks '1' is not in"),
    "ranks a float": ({"ranks": 1.0}, "ranks 1.0 is not in"),
    "ranks huge": ({"ranks": 10**400}, "is not in [1, 2]"),
    "num_tokens a string": ({"num_tokens": "20"}, "num_tokens '20' is not in"),
    "num_tokens negative": ({"num_tokens": -20}, "num_tokens -20 is not in"),
    "num_tokens the whole prompt": ({"num_tokens": 21}, "num_tokens 21 is not in"),
    "transfer_id a path": ({"transfer_id": "../../../etc/passwd"}, "not a syshax transfer id"),
    "transfer_id with a separator": ({"transfer_id": "0" * 31 + "/"}, "not a syshax transfer"),
    "transfer_id upper case": ({"transfer_id": "A" * 32}, "not a syshax transfer id"),
    "transfer_id an integer": ({"transfer_id": 7}, "not a syshax transfer id"),
    "producer a list": ({"producer_engine_id": ["gpu"]}, "is not an engine id"),
    "producer a path": ({"producer_engine_id": "../gpu"}, "was produced by engine '../gpu'"),
    "producer too long": ({"producer_engine_id": "g" * 300}, "is not an engine id"),
    "namespace empty": ({"ipc_namespace": ""}, "IPC namespace"),
    "namespace a number": ({"ipc_namespace": 1}, "IPC namespace 1 "),
    "geometry a float for an int": ({"geometry": {**TINY_GEOMETRY, "layers": 2.0}}, "geometry"),
    "geometry missing a key": (
        {"geometry": {k: v for k, v in TINY_GEOMETRY.items() if k != "kv_dtype"}},
        "geometry",
    ),
    "geometry a list": ({"geometry": [2, 2, 64]}, "geometry"),
    "geometry deeply nested": ({"geometry": json.loads("[" * 900 + "]" * 900)}, "geometry"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_every_hostile_field_is_a_segment_error_naming_it(case: str) -> None:
    """The checks are total: whatever JSON a client sends, a SegmentError with the field's
    name, never another exception (the simulator relies on this too)."""
    change, words = HOSTILE[case]
    with pytest.raises(shm.SegmentError) as raised:
        check(change)
    assert words in str(raised.value), str(raised.value)
    assert len(str(raised.value)) < 800


def test_a_lease_is_capped_by_the_engine_s_configured_lease_not_the_client() -> None:
    now = time.time()
    assert check({}).ranks == 1
    # The producer rounds its expiry up to a whole second: one second of slack.
    last = now + LEASE + 1
    assert check({"lease_expires_at": last}, max_lease_seconds=LEASE, now=now).expires_at == last
    with pytest.raises(shm.SegmentError, match="past this engine's lease of 30s"):
        check({"lease_expires_at": last + 1}, max_lease_seconds=LEASE, now=now)


def test_show_never_raises_and_stays_short() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    assert shm.show(deep) == "<list>"
    assert len(shm.show("x" * 10_000)) == 64


# ------------------------------------------------------------------ the producer


def flood_prefill(producer: Engine, params: dict[str, Any], tokens: int = 20) -> dict[str, Any]:
    """One prefill with the client's own ``kv_transfer_params``, saved and finished; its
    answer's parameters."""
    rid = f"flood-{next(harness._ids)}"
    req = harness.request(rid, list(range(tokens)), params)
    assert producer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = producer.allocate(rid, tokens)
    meta = producer.scheduler.build_connector_meta(harness.scheduled(rid, tokens, blocks))
    prefill = harness.Prefill(rid, req.prompt_token_ids, meta)
    with producer.step(meta):
        harness.save_layers(producer)
    harness.finish_prefill(producer, prefill)
    harness.poll_sent(producer)
    assert prefill.params is not None
    return prefill.params


@pytest.mark.parametrize("flag", ["yes", 1, [True], {"on": True}, "false"])
def test_a_do_remote_decode_that_is_not_true_falls_back(
    pair: Any, shm_dir: Path, flag: Any, caplog: pytest.LogCaptureFixture
) -> None:
    producer, _ = pair
    with caplog.at_level(logging.WARNING):
        params = flood_prefill(producer, {"do_remote_decode": flag})
    assert "is not true" in params["syshax_kv_fallback"]
    assert "falls back" in caplog.text
    assert segment_files(shm_dir) == []


def disk_bytes(shm_dir: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in shm_dir.iterdir())


def test_a_flood_of_prefills_holds_no_more_than_the_arena_for_no_longer_than_the_lease(
    pair: Any, shm_dir: Path
) -> None:
    """Sixty prefills whose decodes never come, each asking for a lease of its own: sixteen
    publish (the arena's sixteen slabs), the rest fall back; the directory grows by the
    segment files' few bytes only, and every lease is the engine's configured 30 s."""
    producer, _ = pair
    arena = disk_bytes(shm_dir)
    hostile = {
        "do_remote_decode": True,
        "lease_expires_at": math.inf,
        "lease_seconds": 10**9,
        "ranks": 0,
        "transfer_id": "../../x",
    }
    answers = [flood_prefill(producer, hostile) for _ in range(60)]
    published = [a for a in answers if "transfer_id" in a]
    assert len(published) == 16
    assert all("arena full" in a["syshax_kv_fallback"] for a in answers if a not in published)
    assert len(segment_files(shm_dir)) == 16
    assert disk_bytes(shm_dir) <= arena + 16 * 8192
    latest = math.ceil(time.time() + 30)
    assert all(a["lease_expires_at"] <= latest for a in published)
    assert all(name.endswith(str(a["lease_expires_at"])) for name, a in zip(
        sorted(segment_files(shm_dir)), sorted(published, key=lambda a: a["segment"]), strict=True
    ))  # fmt: skip


def test_a_prefill_asked_again_after_its_store_was_planned_plans_no_second_one(
    pair: Any, shm_dir: Path
) -> None:
    """vLLM asks again for a request it preempted: a second store would take a second run,
    and the first would be lost to the arena for good."""
    producer, _ = pair
    prefill = harness.plan_prefill(producer, 20)
    assert len(prefill.meta.stores) == 1
    req = harness.request(prefill.rid, prefill.prompt, {"do_remote_decode": True})
    assert producer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = producer.request_blocks[prefill.rid]
    again = producer.scheduler.build_connector_meta(harness.scheduled(prefill.rid, 20, blocks))
    assert again.stores == []
    with producer.step(prefill.meta):
        harness.save_layers(producer)
    harness.finish_prefill(producer, prefill)
    harness.poll_sent(producer)
    assert len(segment_files(shm_dir)) == 1
    assert len([prefill_and_send(producer)[0] for _ in range(15)]) == 15  # the other slabs


def test_a_store_that_fails_while_planned_gives_its_run_and_files_back(
    pair: Any, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full /dev/shm refuses the segment's file: the prefill falls back, and its run comes
    back to the arena (twenty such failures, more than the arena's slabs, leave it whole)."""
    producer, _ = pair

    def full(path: str, data: bytes, *, create: bool = True) -> None:
        open(path, "wb").close()  # created, then the tmpfs is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm, "write_file", full)
    for _ in range(20):
        params = flood_prefill(producer, {"do_remote_decode": True})
        assert "No space left on device" in params["syshax_kv_fallback"]
    assert segment_files(shm_dir) == []
    monkeypatch.undo()
    assert len([prefill_and_send(producer)[0] for _ in range(16)]) == 16


class Exploding:
    """A request whose status cannot be read."""

    def __init__(self, rid: str) -> None:
        self.request_id = rid
        self.prompt_token_ids = list(range(20))
        self.kv_transfer_params: dict[str, Any] = {"do_remote_decode": True}

    @property
    def status(self) -> Any:
        raise KeyError("status")


def test_request_finished_that_fails_answers_a_fallback_and_keeps_the_blocks(
    pair: Any, shm_dir: Path
) -> None:
    producer, _ = pair
    prefill = harness.plan_prefill(producer, 20)
    delay, params = producer.scheduler.request_finished(Exploding(prefill.rid), [])
    assert delay is True  # the copy may be in flight: vLLM keeps the blocks
    assert params is not None and "KeyError" in params["syshax_kv_fallback"]
    with producer.step(prefill.meta):
        harness.save_layers(producer)
    producer.finished.add(prefill.rid)
    assert harness.poll_sent(producer) == {prefill.rid}  # discarded, then reported
    assert segment_files(shm_dir) == []
    fell_back = Exploding("fell-back")
    fell_back.kv_transfer_params = {"do_remote_decode": "yes"}
    producer.scheduler.get_num_new_matched_tokens(fell_back, 0)
    delay, params = producer.scheduler.request_finished(fell_back, [])
    assert delay is False and params is not None and "KeyError" in params["syshax_kv_fallback"]


def test_update_connector_output_that_fails_for_one_request_goes_on(
    pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    producer, _ = pair
    one, two = harness.plan_prefill(producer, 20), harness.plan_prefill(producer, 20)
    planner = producer.scheduler.planner
    planner._planned[one.rid].run = shm.Run(10**6, 1)  # a run no arena has
    planner._planned[one.rid].cancelled = True
    with caplog.at_level(logging.ERROR):
        producer.scheduler.update_connector_output(
            harness.NS(finished_sending={one.rid, two.rid}, finished_recving=set())
        )
    assert "its run not recorded" in caplog.text
    assert not planner._planned  # the other one was recorded


# ------------------------------------------------------------------ the consumer


def test_update_state_after_alloc_that_fails_reports_the_load_failed(pair: Any) -> None:
    """The request waits for its load: the worker reports it failed at its next step (vLLM
    then recomputes it), never a request left waiting for good."""
    producer, consumer = pair
    prefill, _ = prefill_and_send(producer)
    rid = "decode-alloc"
    req = harness.request(rid, [*prefill.prompt, 7], prefill.params)
    assert consumer.scheduler.get_num_new_matched_tokens(req, 0) == (20, True)
    consumer.allocate(rid, 21)

    class Blocks:
        def get_block_ids(self) -> Any:
            raise IndexError("no group 0")

    consumer.scheduler.update_state_after_alloc(req, Blocks(), 20)
    with consumer.step(consumer.scheduler.build_connector_meta(harness.idle())) as s:
        pass
    assert rid in s.results.failed_recving and rid in s.results.finished_recving


def test_a_load_that_failed_recomputes_without_a_second_check(
    pair: Any, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM (kv_load_failure_policy recompute) asks again for a request whose load failed:
    it recomputes at once, and its answer names the failure."""
    producer, consumer = pair
    assert consumer.scheduler._kv_transfer_config.kv_load_failure_policy == "recompute"
    prefill, _ = prefill_and_send(producer)
    assert prefill.params is not None
    (shm_dir / prefill.params["segment"]).write_bytes(b"garbage")
    decode = harness.plan_decode(consumer, prefill)
    results = harness.run_load(consumer, decode)
    assert decode.rid in results.failed_recving
    consumer.scheduler.update_connector_output(
        harness.NS(
            finished_sending=set(),
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )
    )
    req = harness.request(decode.rid, [*prefill.prompt, 7], prefill.params)
    with caplog.at_level(logging.ERROR):
        assert consumer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "not found" not in caplog.text  # not checked again: its files are gone
    req.status = harness.request_status().FINISHED_LENGTH_CAPPED
    _, answer = consumer.scheduler.request_finished(req, [])
    assert answer == {"syshax_kv_error": "its load failed (logged above)"}


def test_tokens_of_another_shape_are_refused_before_the_cache_is_written(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Per-token KV whose heads and head size multiply out to the same bytes but not to this
    engine's cache: named, before any kernel sees it."""
    producer, consumer = make_pair(shm_dir, backend=harness.FLASH)
    try:
        prefill, _ = prefill_and_send(producer, 20)
        assert prefill.params is not None
        path = shm_dir / prefill.params["segment"]
        header = shm.read_header(str(path))
        for piece in header["layers"].values():
            piece["shape"] = [2, 20, 1, 128]
        path.write_bytes(shm.encode_header(header))
        decode = harness.plan_decode(consumer, prefill)
        with caplog.at_level(logging.ERROR):
            results = harness.run_load(consumer, decode)
        assert decode.rid in results.failed_recving
        assert "the segment's tokens [(2, 20, 1, 128)] are not [2, >= 20 tokens" in caplog.text
    finally:
        close((producer, consumer))


# ------------------------------------------------------------------ a broken engine


BROKEN = {
    "host memory": MemoryError(),
    "a CUDA error": torch.AcceleratorError("CUDA error: an illegal memory access"),
    "a CUDA error before torch 2.8": RuntimeError("CUDA error: device-side assert triggered"),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_a_broken_engine_is_not_hidden_behind_a_recompute(
    pair: Any, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    producer, consumer = pair
    exc = BROKEN[what]
    prefill, _ = prefill_and_send(producer)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise exc

    # The scheduler's match,
    with monkeypatch.context() as m:
        m.setattr(shm, "check_params", broken)
        with pytest.raises(type(exc)):
            harness.plan_decode(consumer, prefill)
    # the worker's load,
    decode = harness.plan_decode(consumer, prefill)
    monkeypatch.setattr(consumer.worker._copier, "_load", broken)
    with pytest.raises(type(exc)):
        harness.run_load(consumer, decode)
    # and the worker's save (the step's gather, in wait_for_save).
    again = harness.plan_prefill(producer, 20)
    monkeypatch.setattr(producer.worker._copier.saver, "_gather_host", broken)
    with pytest.raises(type(exc)), producer.step(again.meta):
        harness.save_layers(producer)


def test_one_request_s_exception_in_a_worker_hook_fails_that_transfer_only(
    pair: Any, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save that cannot be published is discarded (its decode finds it gone and
    recomputes); a load that raises is reported failed; the engine's step goes on."""
    producer, consumer = pair
    prefill = harness.plan_prefill(producer, 20)
    with monkeypatch.context() as m:
        m.setattr(shm, "encode_header", lambda header: json.dumps(object()))  # TypeError
        with caplog.at_level(logging.ERROR), producer.step(prefill.meta):
            harness.save_layers(producer)
        harness.finish_prefill(producer, prefill)
        assert prefill.rid in harness.poll_sent(producer)
    assert "discarded: TypeError" in caplog.text
    assert segment_files(shm_dir) == []
    good, _ = prefill_and_send(producer)
    decode = harness.plan_decode(consumer, good)
    monkeypatch.setattr(
        consumer.worker._copier, "_load", lambda op, ctx: [][0]
    )  # IndexError, as ranks 0 once raised
    with caplog.at_level(logging.ERROR):
        results = harness.run_load(consumer, decode)
    assert decode.rid in results.failed_recving
    assert "it recomputes its prompt: IndexError" in caplog.text
