"""SyshaxShmConnector, both sides driven as vLLM drives them (kvbench/harness.py), on
the CPU with real vLLM's base classes: the handoff, the arena and its fallback, the
asynchronous contract, and every lie or failure the issue names, each ending in a counted
fallback, a recompute or a failed load with its cause, never an exception into the engine."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvbench import harness
from kvbench.harness import FLASH, Engine
from tests.kvconnector.pairs import close, make_pair

shm = harness.load_connector().shm


def prefill_and_send(producer: Engine, tokens: int = 20) -> tuple[harness.Prefill, list[int]]:
    """A whole prefill step with its saves, the request finished, its copies landed."""
    prefill = harness.plan_prefill(producer, tokens)
    blocks = list(producer.request_blocks[prefill.rid])
    with producer.step(prefill.meta):
        harness.save_layers(producer)
    harness.finish_prefill(producer, prefill)
    assert harness.poll_sent(producer) == {prefill.rid}
    return prefill, blocks


def segment_files(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith("syshax-kv-"))


def test_the_consumer_loads_exactly_what_the_producer_saved(pair: Any, shm_dir: Path) -> None:
    producer, consumer = pair
    prefill, blocks = prefill_and_send(producer, 40)
    params = prefill.params
    assert params["num_tokens"] == 40 and params["ranks"] == 1
    assert segment_files(shm_dir) == [params["segment"]]
    decode = harness.plan_decode(consumer, prefill)
    assert decode.matched == (40, True)  # loaded asynchronously, between steps
    results = harness.run_load(consumer, decode)
    assert decode.rid in results.finished_recving and not results.failed_recving
    assert harness.same_kv(producer, blocks, consumer, decode, 40)
    assert segment_files(shm_dir) == []  # loaded segments are unlinked at once


def test_per_token_kv_travels_as_tokens_into_a_per_token_layout(shm_dir: Path) -> None:
    """FlashAttention's layout (what a CUDA producer has), here on the CPU: the KV travels
    as [2, tokens, heads, head_size] and is written token by token into the consumer."""
    producer, consumer = make_pair(shm_dir, backend=FLASH)
    try:
        prefill, blocks = prefill_and_send(producer, 37)
        header = shm.read_header(str(shm_dir / prefill.params["segment"]))
        assert header["format"] == "tokens"
        assert header["layers"]["model.layers.0.self_attn.attn"]["shape"] == [2, 37, 2, 64]
        decode = harness.plan_decode(consumer, prefill)
        assert decode.rid in harness.run_load(consumer, decode).finished_recving
        assert harness.same_kv(producer, blocks, consumer, decode, 37)
    finally:
        close((producer, consumer))


def test_a_decode_that_arrives_before_the_copy_waits_without_holding_steps(pair: Any) -> None:
    """The prefill's answer can reach the router before its copy lands: the decode waits
    for the segment in WAITING_FOR_REMOTE_KVS while its engine keeps stepping."""
    producer, consumer = pair
    prefill = harness.plan_prefill(producer, 20)
    blocks = list(producer.request_blocks[prefill.rid])
    harness.finish_prefill(producer, prefill)  # answered; the copy has not run yet
    decode = harness.plan_decode(consumer, prefill)
    assert decode.matched == (20, True)
    waiting = harness.run_load(consumer, decode, max_steps=5)  # five steps, none held
    assert decode.rid not in waiting.finished_recving
    with producer.step(prefill.meta):
        harness.save_layers(producer)
    harness.poll_sent(producer)
    results = harness.run_load(consumer, decode)
    assert decode.rid in results.finished_recving and not results.failed_recving
    assert harness.same_kv(producer, blocks, consumer, decode, 20)


def test_a_copy_that_never_lands_fails_the_load_at_its_lease(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    producer, consumer = make_pair(shm_dir, lease=0.5)
    try:
        prefill = harness.plan_prefill(producer, 20)
        harness.finish_prefill(producer, prefill)  # the producer then dies before its step
        decode = harness.plan_decode(consumer, prefill)
        assert decode.matched == (20, True)
        time.sleep(1.6)  # the lease, rounded up to whole seconds
        with caplog.at_level(logging.ERROR):
            results = harness.run_load(consumer, decode)
        assert decode.rid in results.failed_recving and decode.rid in results.finished_recving
        assert "had not landed when the lease ended" in caplog.text
        assert (
            "SyshaxShmConnector cpu" in caplog.text and prefill.params["transfer_id"] in caplog.text
        )
    finally:
        close((producer, consumer))


def test_a_full_arena_falls_back_and_its_runs_come_back_when_loaded(pair: Any) -> None:
    producer, consumer = pair
    held = [prefill_and_send(producer, 20)[0] for _ in range(16)]  # 16 slabs of 64 KiB
    assert all(p.params and "transfer_id" in p.params for p in held)
    full, _ = prefill_and_send_fallback(producer, 20)
    assert "arena full" in full["syshax_kv_fallback"]
    assert "the transfer needs" in full["syshax_kv_fallback"]
    decode = harness.plan_decode(consumer, held[0])  # one decode comes and loads
    assert decode.rid in harness.run_load(consumer, decode).finished_recving
    again = prefill_and_send(producer, 20)[0]
    assert "transfer_id" in again.params  # its run was reclaimed


def prefill_and_send_fallback(producer: Engine, tokens: int) -> tuple[dict[str, Any], Any]:
    prefill = harness.plan_prefill(producer, tokens)
    assert prefill.meta.stores == []  # no copy was planned
    with producer.step(prefill.meta):
        harness.save_layers(producer)
    harness.finish_prefill(producer, prefill)
    assert prefill.params is not None and "transfer_id" not in prefill.params
    return prefill.params, prefill


def test_a_transfer_larger_than_the_arena_falls_back(shm_dir: Path) -> None:
    producer, consumer = make_pair(shm_dir, arena_mib=0.25)  # four slabs of 64 KiB
    try:
        params, _ = prefill_and_send_fallback(producer, 16 * 20)  # 20 blocks x 2 layers x 8 KiB
        assert "the transfer needs 320 KiB" in params["syshax_kv_fallback"]
    finally:
        close((producer, consumer))


def test_an_engine_without_arena_falls_back_for_every_prefill(pair: Any) -> None:
    _, consumer = pair  # arena_mib 0
    params, _ = prefill_and_send_fallback(consumer, 20)
    assert "no KV arena" in params["syshax_kv_fallback"]


@pytest.mark.parametrize("status", ["FINISHED_STOPPED", "FINISHED_ABORTED", "FINISHED_ERROR"])
def test_a_prefill_that_ends_otherwise_publishes_nothing_and_frees_its_run(
    pair: Any, shm_dir: Path, status: str
) -> None:
    producer, _ = pair
    for _ in range(20):  # more than the arena holds: every run came back
        prefill = harness.plan_prefill(producer, 20)
        with producer.step(prefill.meta):
            harness.save_layers(producer)
        harness.finish_prefill(producer, prefill, status)
        assert prefill.params is None  # no parameters: nothing to decode from
        assert prefill.rid in harness.poll_sent(producer)  # the blocks come back once discarded
        assert segment_files(shm_dir) == []


def test_an_abort_while_the_copy_is_in_flight_never_publishes(pair: Any, shm_dir: Path) -> None:
    producer, _ = pair
    prefill = harness.plan_prefill(producer, 20)
    harness.finish_prefill(producer, prefill, "FINISHED_ABORTED")  # before the step's copies
    assert producer.request_blocks.get(prefill.rid)  # blocks held: the copy may be in flight
    with producer.step(prefill.meta):
        harness.save_layers(producer)
    assert prefill.rid in harness.poll_sent(producer)
    assert segment_files(shm_dir) == []


LIES: dict[str, Any] = {
    "offset outside its run": lambda h: h["layers"][LAYER].update(offset=h["offset"] + h["length"]),
    "unaligned offset": lambda h: h["layers"][LAYER].update(offset=h["offset"] + 2),
    "shape larger than the run": lambda h: h["layers"][LAYER].update(shape=[2, 10**6, 2, 64]),
    "negative shape": lambda h: h["layers"][LAYER].update(shape=[2, -20, 2, 64]),
    "unknown dtype": lambda h: h["layers"][LAYER].update(dtype="complex128"),
    "run past the arena": lambda h: h.update(offset=2**40),
    "another transfer's header": lambda h: h.update(transfer_id="f" * 32),
    "missing layer": lambda h: h["layers"].pop(LAYER),
    "negative offset": lambda h: h["layers"][LAYER].update(offset=-4096),
    "length past the arena": lambda h: h.update(length=2**40),
    "arena path traversal": lambda h: h.update(arena="../../../etc/passwd"),
    "arena name with a separator": lambda h: h.update(arena="syshax-arena-gpu-r0/../../x"),
    "layout not an object": lambda h: h.update(layout=["pages"]),
}
LAYER = "model.layers.1.self_attn.attn"
CAUSES = {
    "offset outside its run": "outside its run",
    "unaligned offset": "outside its run",
    "shape larger than the run": "outside its run",
    "negative shape": "not a list of positive integers",
    "unknown dtype": "is not one this connector reads",
    "run past the arena": "offset",
    "another transfer's header": "another transfer",
    "missing layer": "no layer",
    "negative offset": "offset -4096 is not an integer",
    "length past the arena": "length",
    "arena path traversal": "names no arena of ours",
    "arena name with a separator": "names no arena of ours",
    "layout not an object": "layout is not an object",
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_segment_header_that_lies_fails_the_load_naming_the_field(
    pair: Any, shm_dir: Path, lie: str, caplog: pytest.LogCaptureFixture
) -> None:
    producer, consumer = pair
    prefill, _ = prefill_and_send(producer)
    path = shm_dir / prefill.params["segment"]
    header = shm.read_header(str(path))
    LIES[lie](header)
    path.write_bytes(shm.encode_header(header))
    decode = harness.plan_decode(consumer, prefill)
    with caplog.at_level(logging.ERROR):
        results = harness.run_load(consumer, decode)
    assert decode.rid in results.failed_recving
    assert CAUSES[lie] in caplog.text, caplog.text
    assert segment_files(shm_dir) == []  # the unusable transfer is unlinked, its run freed


@pytest.mark.parametrize(
    "damage,cause",
    [
        (lambda data: data[:30], "truncated"),
        (lambda data: b"NOTKVSEG" + data[8:], "not a syshax KV segment"),
        (lambda data: data[:8] + (9).to_bytes(4, "little") + data[12:], "format 9"),
        (lambda data: data[:16] + b"[" + data[17:], "not JSON"),
    ],
    ids=["truncated", "bad-magic", "other-format", "not-json"],
)
def test_a_damaged_segment_file_fails_the_load_naming_the_cause(
    pair: Any, shm_dir: Path, damage: Any, cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    producer, consumer = pair
    prefill, _ = prefill_and_send(producer)
    path = shm_dir / prefill.params["segment"]
    path.write_bytes(damage(path.read_bytes()))
    decode = harness.plan_decode(consumer, prefill)
    with caplog.at_level(logging.ERROR):
        results = harness.run_load(consumer, decode)
    assert decode.rid in results.failed_recving
    assert cause in caplog.text, caplog.text


# What the tiny model's engines answer as their geometry.
TINY_GEOMETRY = {
    "layers": 2,
    "kv_heads": 2,
    "head_size": 64,
    "kv_dtype": "auto",
    "model_dtype": "torch.bfloat16",
}
BAD_PARAMS: dict[str, Any] = {
    "lease nan": {"lease_expires_at": math.nan},
    "lease infinite": {"lease_expires_at": math.inf},
    "lease a string": {"lease_expires_at": "nan"},
    "lease next year": {"lease_expires_at": time.time() + 365 * 86400},
    "ranks zero": {"ranks": 0},
    "ranks too many": {"ranks": 999},
    "ranks a float": {"ranks": 1.0},
    "num_tokens a bool": {"num_tokens": True},
    "num_tokens past the prompt": {"num_tokens": 10**9},
    "num_tokens negative": {"num_tokens": -3},
    "transfer_id a list": {"transfer_id": ["a"]},
    "transfer_id a path": {"transfer_id": "../../etc/passwd"},
    "other geometry": {"geometry": {"layers": 80}},
    "other producer": {"producer_engine_id": "gpu-of-another-deployment"},
    "other namespace": {"ipc_namespace": "ipc:[1]"},
    "unknown transfer": {"transfer_id": "0" * 32},
    # What a JSON body can carry (json.loads reads 1e999 as inf, NaN as nan).
    "lease 1e999 in JSON": json.loads('{"lease_expires_at": 1e999}'),
    "lease NaN in JSON": json.loads('{"lease_expires_at": NaN}'),
    "lease -Infinity in JSON": json.loads('{"lease_expires_at": -Infinity}'),
    "lease an integer past any float": {"lease_expires_at": 10**400},
    "lease negative": {"lease_expires_at": -5},
    "lease a bool": {"lease_expires_at": True},
    "lease past this engine's": {"lease_expires_at": int(time.time()) + 600},
    "ranks three": {"ranks": 3},  # the tiny model has 2 KV heads: no producer has 3 ranks
    "ranks negative": {"ranks": -1},
    "ranks a string": {"ranks": "1"},
    "num_tokens a string": {"num_tokens": "20"},
    "num_tokens a float": {"num_tokens": 20.0},
    "transfer_id with a separator": {"transfer_id": "0" * 31 + "/"},
    "transfer_id an integer": {"transfer_id": 10**40},
    "geometry with a float": {"geometry": {**TINY_GEOMETRY, "layers": 2.0}},
    "geometry with another key": {"geometry": {**TINY_GEOMETRY, "layers_of_mine": 2}},
    "geometry a string": {"geometry": "same"},
    "producer a list": {"producer_engine_id": ["gpu"]},
    "namespace empty": {"ipc_namespace": ""},
    "namespace a list": {"ipc_namespace": ["ipc:[1]"]},
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_parameters_that_lie_recompute_the_prompt_and_never_raise(
    pair: Any, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    producer, consumer = pair
    prefill, _ = prefill_and_send(producer)
    prefill.params = {**prefill.params, **BAD_PARAMS[case]}
    with caplog.at_level(logging.ERROR):
        decode = harness.plan_decode(consumer, prefill)
    assert decode.matched == (0, False)  # the prompt is recomputed
    assert "recomputes its prompt" in caplog.text
    req = harness.request(decode.rid, [], None)
    req.status = harness.request_status().FINISHED_LENGTH_CAPPED
    delay, answer = consumer.scheduler.request_finished(req, [])
    assert delay is False and answer is not None and answer["syshax_kv_error"]
    # The cause is a check that names the field, not an exception that slipped through one.
    assert "Error:" not in answer["syshax_kv_error"], answer


def test_parameters_that_are_not_an_object_are_ignored(pair: Any) -> None:
    _, consumer = pair
    req = harness.request("odd", [1, 2, 3], ["do_remote_decode"])  # type: ignore[arg-type]
    assert consumer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_consumer_that_died_mid_load_frees_the_run_after_the_claim_grace(
    pair: Any, shm_dir: Path
) -> None:
    producer, _ = pair
    held = [prefill_and_send(producer)[0] for _ in range(16)]
    segment = shm_dir / held[0].params["segment"]
    claimed = segment.with_name(segment.name + ".claimed")
    os.rename(segment, claimed)  # a consumer claimed it, then died
    os.utime(claimed, (time.time() - 31, time.time() - 31))  # claimed 31 s ago; grace 30 s
    assert "arena full" in prefill_and_send_fallback(producer, 20)[0]["syshax_kv_fallback"]
    assert shm.reap_expired(str(shm_dir), claim_grace=30.0) == [claimed.name]
    assert "transfer_id" in prefill_and_send(producer)[0].params


def test_the_reaper_frees_published_segments_at_their_lease(shm_dir: Path) -> None:
    producer, consumer = make_pair(shm_dir, lease=0.3)
    try:
        prefill, _ = prefill_and_send(producer)
        assert segment_files(shm_dir)
        time.sleep(1.4)  # one lease and a reap interval
        assert shm.reap_expired(str(shm_dir), claim_grace=0.3) == [prefill.params["segment"]]
    finally:
        close((producer, consumer))


def test_a_restarted_producer_keeps_the_runs_of_live_segments(shm_dir: Path) -> None:
    producer, consumer = make_pair(shm_dir)
    held = [prefill_and_send(producer)[0] for _ in range(16)]
    close((producer, consumer), crash=True)
    restarted, consumer = make_pair(shm_dir)  # same engine id, same arena file
    try:
        assert "arena full" in prefill_and_send_fallback(restarted, 20)[0]["syshax_kv_fallback"]
        decode = harness.plan_decode(consumer, held[3])  # a decode of the old engine's transfer
        assert decode.rid in harness.run_load(consumer, decode).finished_recving
        assert "transfer_id" in prefill_and_send(restarted)[0].params
    finally:
        close((restarted, consumer))


def test_an_aborted_decode_that_waits_is_released_and_its_transfer_unlinked(
    pair: Any, shm_dir: Path
) -> None:
    producer, consumer = pair
    prefill = harness.plan_prefill(producer, 20)
    harness.finish_prefill(producer, prefill)
    decode = harness.plan_decode(consumer, prefill)
    harness.run_load(consumer, decode, max_steps=2)  # waiting for the copy
    with consumer.step(consumer.scheduler.build_connector_meta(harness.idle()), {decode.rid}) as s:
        pass
    assert decode.rid in s.results.finished_recving  # its blocks can be freed
    assert segment_files(shm_dir) == []


def test_a_tmpfs_too_small_for_the_arena_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve a 64 MiB KV arena in .*--shm-size"):
        shm.create_arena(str(tmp_path / "arena"), 64 << 20)


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"lease_seconds": "soon"}, "lease_seconds"),
        ({"lease_seconds": math.nan}, "lease_seconds"),
        ({"lease_seconds": 0}, "lease_seconds"),
        ({"arena_mib": -1}, "arena_mib"),
        ({"slab_kib": 6}, "slab_kib"),
        ({"reap_interval_seconds": True}, "reap_interval_seconds"),
    ],
)
def test_bad_extra_config_stops_the_engine_naming_the_key(
    extra: dict[str, Any], field: str
) -> None:
    settings = harness.load_connector().Settings
    with pytest.raises(ValueError, match=field):
        settings.parse(extra, "engine")


def test_the_header_is_json_after_the_magic(pair: Any, shm_dir: Path) -> None:
    producer, _ = pair
    prefill, _ = prefill_and_send(producer)
    data = (shm_dir / prefill.params["segment"]).read_bytes()
    assert data[:8] == b"SYSHAXKV"
    header = json.loads(data[16:])
    assert header["arena"] == shm.arena_name("gpu", 0) and header["format"] == "pages"


def arenas(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith("syshax-arena-"))


def owners(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith("syshax-owner-"))


def test_a_clean_shutdown_removes_the_arena(shm_dir: Path) -> None:
    engines = make_pair(shm_dir)
    assert arenas(shm_dir) == [shm.arena_name("gpu", 0)]
    close(engines)
    assert arenas(shm_dir) == [] and owners(shm_dir) == []


def test_the_arena_of_a_crashed_producer_goes_once_its_segments_do(shm_dir: Path) -> None:
    producer, consumer = make_pair(shm_dir, lease=0.3)
    prefill, _ = prefill_and_send(producer)
    assert shm.reap_arenas(str(shm_dir)) == []  # its producer holds it
    close((producer, consumer), crash=True)
    assert shm.reap_arenas(str(shm_dir)) == []  # a published segment still points into it
    time.sleep(1.4)
    assert shm.reap_expired(str(shm_dir), claim_grace=0.3) == [prefill.params["segment"]]
    assert shm.reap_arenas(str(shm_dir)) == [shm.arena_name("gpu", 0)]
    assert arenas(shm_dir) == [] and owners(shm_dir) == []
