"""The router reads the engines' KV events only to keep its prefix index honest, and holds any
stream it reads within bounds: one that stops, lies, floods or sends garbage is counted and
the replica choice falls back to the text index alone."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from common.supervisor import ReadyChild, free_port, python_argv
from router.kv_events import Health, KvEventLimits, KvEventStreams, KvEventTracker, Outcome
from router.prefix_index import PrefixIndex

ROOT = Path(__file__).resolve().parents[2]


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, [1] * 16 * len(hashes), 16, None, "GPU", None)


def message(seq: int, *events: object, topic: bytes = b"") -> list[bytes]:
    payload = msgspec.msgpack.encode(KVEventBatch(time.time(), list(events)))  # type: ignore[arg-type]
    return [topic, seq.to_bytes(8, "big"), payload]


class Harness:
    def __init__(self, role: str = "gpu", **limits: int) -> None:
        self.registry = CollectorRegistry()
        self.streams = KvEventStreams(self.forget, self.registry, KvEventLimits(**limits))
        self.forgotten: list[int] = []
        self.tracker = KvEventTracker(
            (7, role), "m-a", self.streams.limits, self.streams.metrics, self.forget, 0.0
        )
        self.now = 100.0

    def forget(self, replica: int) -> None:
        self.forgotten.append(replica)

    def send(self, frames: list[bytes]) -> Outcome:
        self.now += 0.01
        return self.tracker.receive(frames, self.now)

    def count(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, {"replica": "m-a", "role": "gpu", **labels})
        return value or 0.0


def test_blocks_are_counted_and_a_clear_forgets_the_replica() -> None:
    h = Harness()
    assert h.send(message(0, stored(1, 2, 3))) is Outcome.APPLIED
    assert h.send(message(1, BlockRemoved([3], "GPU"))) is Outcome.APPLIED
    assert h.count("syshax_router_kv_blocks") == 2 and not h.forgotten
    assert h.send(message(2, AllBlocksCleared())) is Outcome.CLEARED
    assert h.forgotten == [7] and h.count("syshax_router_kv_blocks") == 0
    assert h.count("syshax_router_kv_events_total", outcome="applied") == 2


def test_an_engine_that_starts_again_is_forgotten() -> None:
    h = Harness()
    h.send(message(0, stored(1)))
    h.send(message(1, stored(2, parent=1)))
    assert h.send(message(0, stored(5))) is Outcome.RESTARTED
    assert h.forgotten == [7] and list(h.tracker.blocks) == [5]


def test_an_engine_left_holding_nothing_is_forgotten_but_only_once_a_second() -> None:
    h = Harness()
    h.send(message(0, stored(1, 2)))
    h.send(message(1, BlockRemoved([1, 2], "GPU")))
    assert h.forgotten == [7]
    h.send(message(2, stored(3)))
    h.send(message(3, AllBlocksCleared()))  # within the second: held back
    assert h.forgotten == [7] and h.tracker.forget_pending
    h.tracker.tick(h.now + 1.0, serving=False, interval=1.0)
    assert h.forgotten == [7, 7]


def test_a_stream_joined_late_may_remove_what_it_never_told() -> None:
    h = Harness(max_lies=0)
    h.send(message(41, stored(1)))  # not from seq 0: earlier blocks are unknown here
    assert h.send(message(42, BlockRemoved([99], "GPU"))) is Outcome.APPLIED
    assert h.tracker.health is Health.LIVE


def test_a_stream_that_lies_is_distrusted_until_its_engine_starts_again() -> None:
    h = Harness(max_lies=2)
    h.send(message(0, stored(1)))
    assert h.send(message(1, BlockRemoved([50, 51, 52], "GPU"))) is Outcome.LIE
    assert h.tracker.health is Health.LYING
    assert h.count("syshax_router_kv_events_fallbacks_total", reason="lying") == 1
    assert h.count("syshax_router_kv_events_live") == 0
    h.send(message(2, AllBlocksCleared()))  # a liar's clear forgets nothing
    assert not h.forgotten and h.tracker.health is Health.LYING
    h.send(message(0, stored(1)))  # the engine started again: a new stream
    assert h.tracker.health is Health.LIVE and h.count("syshax_router_kv_events_live") == 1


def test_a_gap_makes_unknown_removals_no_lie() -> None:
    h = Harness(max_lies=0)
    h.send(message(0, stored(1)))
    assert h.send(message(5, stored(2))) is Outcome.GAP
    assert h.send(message(6, BlockRemoved([77], "GPU"))) is Outcome.APPLIED


def test_garbage_is_counted_and_distrusts_the_stream_when_it_goes_on() -> None:
    h = Harness(max_garbage=3)
    for frames in ([b"", b"\x00"], [b"", b"12345678", b"\xc1"], [b"", b"12345678", b"[1]"]):
        assert h.send(frames) is Outcome.GARBAGE
    assert h.tracker.health is Health.GARBAGE
    assert h.count("syshax_router_kv_events_total", outcome="garbage") == 3
    h.send(message(0, stored(1)))
    assert h.tracker.health is Health.LIVE


def test_a_flood_is_cut_at_the_rate_bound() -> None:
    h = Harness(max_messages_per_s=10)
    h.now = 200.0
    outcomes = [h.tracker.receive(message(i, stored(i + 1)), 200.5) for i in range(12)]
    assert outcomes[:10] == [Outcome.APPLIED] * 10 and outcomes[10] is Outcome.FLOOD
    assert h.tracker.health is Health.FLOODING
    assert h.tracker.flood_pause(200.5) == pytest.approx(0.5)
    assert h.tracker.receive(message(30, stored(99)), 201.1) is Outcome.GAP
    assert h.tracker.health is Health.LIVE


def test_a_silent_stream_of_a_serving_engine_is_distrusted() -> None:
    h = Harness(silent_intervals=3)
    h.tracker.tick(2.0, serving=True, interval=1.0)
    assert h.tracker.health is Health.LIVE
    h.tracker.tick(50.0, serving=False, interval=1.0)  # idle engines have nothing to say
    assert h.tracker.health is Health.LIVE
    h.tracker.tick(50.0, serving=True, interval=1.0)
    assert h.tracker.health is Health.SILENT
    assert h.count("syshax_router_kv_events_fallbacks_total", reason="silent") == 1


def test_the_tracked_blocks_are_capped() -> None:
    h = Harness(max_blocks=100, max_lies=0)
    h.send(message(0, stored(*range(1, 1001))))
    assert len(h.tracker.blocks) == 100 and next(iter(h.tracker.blocks)) == 901
    assert h.send(message(1, BlockRemoved([5], "GPU"))) is Outcome.APPLIED  # dropped, no lie


def test_prefix_index_forget_drops_one_replica() -> None:
    index = PrefixIndex()
    index.record([1, 2], 7)
    index.record([1], 8)
    index.forget(7)
    assert index.match([1, 2], [7, 8]) == [0, 1] and len(index) == 1


# -- over a socket -----------------------------------------------------------------------------


def test_a_hostile_publisher_is_bounded() -> None:
    registry = CollectorRegistry()

    async def scenario() -> list[int]:
        port = free_port()
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(1_000_000)
        pub.bind(f"tcp://127.0.0.1:{port}")
        forgotten: list[int] = []
        streams = KvEventStreams(forgotten.append, registry, KvEventLimits(max_messages_per_s=200))
        streams.want({(7, "gpu"): (f"tcp://127.0.0.1:{port}", "m-a")})
        runner = asyncio.create_task(streams.run(lambda: 0.1, lambda key: True))
        await asyncio.sleep(0.5)
        pub.send_multipart(message(0, stored(1)))
        pub.send_multipart([b"", b"\x00" * 8, b"\xff\xfe garbage"])
        for seq in range(1, 20_001):  # a flood, many times the bound
            pub.send_multipart(message(seq, stored(seq + 1)))
        started = time.monotonic()
        await asyncio.sleep(1.5)
        elapsed = time.monotonic() - started
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        pub.close()
        assert elapsed < 3
        return forgotten

    forgotten = asyncio.run(scenario())

    def count(outcome: str) -> float:
        labels = {"replica": "m-a", "role": "gpu", "outcome": outcome}
        return registry.get_sample_value("syshax_router_kv_events_total", labels) or 0.0

    assert count("garbage") == 1
    assert count("flood") >= 1
    # At most the bound a second is read: 1.5 s of reading, 200 a second.
    assert 200 <= count("applied") + count("gap") <= 200 * 3
    assert not forgotten


@pytest.mark.process
@pytest.mark.timeout(60)
def test_the_router_reads_a_simulator_s_events(tmp_path: Path) -> None:
    http_port, port = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    argv = python_argv(
        "sim", "--device", "a100-80gb", "--model", "qwen2.5-7b-instruct", "--speed", "20",
        "--port", str(http_port), "--kv-events-config", config,
    )  # fmt: skip

    async def scenario() -> tuple[float, float, list[int]]:
        forgotten: list[int] = []
        registry = CollectorRegistry()
        streams = KvEventStreams(forgotten.append, registry)
        streams.want({(7, "gpu"): (f"tcp://127.0.0.1:{port}", "m-a")})
        runner = asyncio.create_task(streams.run(lambda: 0.2, lambda key: False))
        sim = ReadyChild("sim", argv, tmp_path, cwd=ROOT, timeout=30)
        try:
            await asyncio.sleep(0.8)
            body = {"model": "qwen2.5-7b-instruct", "prompt": list(range(100, 420)),
                    "max_tokens": 4, "ignore_eos": True}  # fmt: skip
            async with httpx.AsyncClient() as client:
                answer = await client.post(f"{sim.url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200
            await asyncio.sleep(0.5)
            labels = {"replica": "m-a", "role": "gpu"}
            blocks = registry.get_sample_value("syshax_router_kv_blocks", labels) or 0.0
        finally:
            sim.stop()
        # The engine starts again: its seq goes back to 0, and the replica is forgotten.
        sim = ReadyChild("sim", argv, tmp_path, cwd=ROOT, timeout=30)
        try:
            await asyncio.sleep(0.8)
            async with httpx.AsyncClient() as client:
                await client.post(f"{sim.url}/v1/completions", json=body, timeout=30)
            await asyncio.sleep(0.5)
            after = registry.get_sample_value("syshax_router_kv_blocks", labels) or 0.0
        finally:
            sim.stop()
            runner.cancel()
            with pytest.raises(asyncio.CancelledError):
                await runner
        return blocks, after, forgotten

    blocks, after, forgotten = asyncio.run(scenario())
    assert blocks == (320 + 4 - 1) // 16
    assert after == blocks and forgotten == [7]
