"""The engines' KV events, where a deployment names them: what keeps the prefix index honest.

The router's prefix index (``router.prefix_index``) is a guess from what it sent where. An
engine that publishes vLLM's KV events (``--kv-events-config``; common/kv_events.py) tells
what it really holds, and the router reads that much of it: an ``AllBlocksCleared``, a seq
that starts again (the engine restarted) or a GPU engine left holding no block forgets that
replica in the index; every stream's blocks are counted (``syshax_router_kv_blocks``).

A stream is untrusted input, so each one is bounded and judged (``Health``):

- memory: the blocks tracked per engine are capped (``max_blocks``, the oldest dropped past
  it); the socket queues at most ``RCVHWM`` messages of at most ``MAX_MESSAGE_BYTES`` each;
- CPU: at most ``max_messages_per_s`` messages are read a second; past that the reader stops
  until the next second and ZMQ drops the rest (``flooding``); forgetting a replica, a walk
  of the index, happens at most once per ``min_forget_s``;
- a stream that says nothing for ``silent_intervals`` scrape intervals while its engine runs
  requests is ``silent``; one that removes more than ``max_lies`` blocks it never stored (while
  the router has seen every batch since the engine's first) is ``lying``; one whose messages
  do not decode ``max_garbage`` times in a row is ``garbage``.

A stream that is not ``live`` changes nothing in the index: the replica's choice falls back
to the text index alone, counted with its reason (``syshax_router_kv_events_fallbacks``). A
silent, flooding or garbled stream is live again at its next good message; a lying one only
once its engine starts again (a seq from 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from common.kv_events import SEQ_BYTES, AllBlocksCleared, BlockStored, batch_decoder

log = logging.getLogger("syshax.router")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a step's batch: a 32k-token prefill is ~100 kB
RCVHWM = 256  # messages the socket holds for a slow reader before ZMQ drops


class Health(StrEnum):
    LIVE = "live"
    SILENT = "silent"
    LYING = "lying"
    FLOODING = "flooding"
    GARBAGE = "garbage"


class Outcome(StrEnum):
    """What became of one message (the ``outcome`` label)."""

    APPLIED = "applied"
    CLEARED = "cleared"  # AllBlocksCleared
    RESTARTED = "restarted"  # the seq went back: the engine started again
    GAP = "gap"  # seqs were skipped: batches lost (the tracked blocks are a lower bound now)
    GARBAGE = "garbage"  # not (topic, 8-byte seq, a KVEventBatch)
    LIE = "lie"  # removed blocks never stored
    FLOOD = "flood"  # over the rate: not read


@dataclass(frozen=True)
class KvEventLimits:
    max_blocks: int = 65536
    max_messages_per_s: int = 2000
    silent_intervals: int = 5
    max_lies: int = 16
    max_garbage: int = 8
    min_forget_s: float = 1.0


# An engine's stream: (deployment id, "gpu" or "cpu").
StreamKey = tuple[int, str]


class KvEventMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.messages = Counter(
            "syshax_router_kv_events",
            "KV event messages from the engines, by what became of them",
            ["replica", "role", "outcome"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "syshax_router_kv_events_fallbacks",
            "Times an engine's KV event stream stopped being trusted (the replica choice "
            "reads the text index alone), by reason",
            ["replica", "role", "reason"],
            registry=registry,
        )
        self.live = Gauge(
            "syshax_router_kv_events_live",
            "1 while an engine's KV event stream is trusted, 0 while it is not",
            ["replica", "role"],
            registry=registry,
        )
        self.blocks = Gauge(
            "syshax_router_kv_blocks",
            "Prefix cache blocks an engine's KV events say it holds (at most the tracked cap)",
            ["replica", "role"],
            registry=registry,
        )

    def remove(self, replica: str, role: str) -> None:
        for family in (self.live, self.blocks):
            with contextlib.suppress(KeyError):
                family.remove(replica, role)


class KvEventTracker:
    """One engine's stream, judged and applied; no I/O (``KvEventStreams`` reads the socket)."""

    def __init__(
        self,
        key: StreamKey,
        name: str,
        limits: KvEventLimits,
        metrics: KvEventMetrics,
        forget: Callable[[int], None],
        now: float,
    ) -> None:
        self.key = key
        self.name = name
        self.limits = limits
        self.metrics = metrics
        self._forget = forget
        self._decode = batch_decoder().decode
        self.blocks: dict[int, None] = {}  # insertion-ordered: the oldest dropped past the cap
        self.health = Health.LIVE
        self.last_seq: int | None = None
        self.complete = False  # every batch seen since the engine's first (or a clear)
        self.last_event_at = now
        self.lies = 0
        self.garbage_run = 0
        self._window = 0
        self._window_count = 0
        self.forget_pending = False
        self._forgot_at = float("-inf")
        metrics.live.labels(name, key[1]).set(1)
        metrics.blocks.labels(name, key[1]).set(0)

    # -- judging -------------------------------------------------------------------------

    def _count(self, outcome: Outcome) -> Outcome:
        self.metrics.messages.labels(self.name, self.key[1], outcome.value).inc()
        return outcome

    def _distrust(self, health: Health) -> None:
        if self.health is Health.LIVE:
            self.metrics.fallbacks.labels(self.name, self.key[1], health.value).inc()
            self.metrics.live.labels(self.name, self.key[1]).set(0)
            log.warning(
                "KV events of %s %s: %s; the text index alone", self.name, self.key[1], health
            )
        self.health = health
        self.forget_pending = False

    def _trust(self) -> None:
        if self.health is not Health.LIVE and self.health is not Health.LYING:
            self.health = Health.LIVE
            self.metrics.live.labels(self.name, self.key[1]).set(1)

    def flood_pause(self, now: float) -> float:
        """How long the reader waits before the next second's messages."""
        return max(0.0, self._window + 1 - now)

    def receive(self, frames: list[bytes], now: float) -> Outcome:
        """One multipart message: judged, then (if the stream is trusted) applied."""
        window = int(now)
        if window != self._window:
            self._window, self._window_count = window, 0
        self._window_count += 1
        if self._window_count > self.limits.max_messages_per_s:
            self._distrust(Health.FLOODING)
            self.complete = False  # what ZMQ drops meanwhile is lost
            return self._count(Outcome.FLOOD)
        batch = None
        if len(frames) == 3 and len(frames[1]) == SEQ_BYTES:
            with contextlib.suppress(msgspec.DecodeError):
                batch = self._decode(frames[2])
        if batch is None:
            self.garbage_run += 1
            if self.garbage_run >= self.limits.max_garbage:
                self._distrust(Health.GARBAGE)
            return self._count(Outcome.GARBAGE)
        self.garbage_run = 0
        self.last_event_at = now
        outcome = self._sequence(int.from_bytes(frames[1], "big"))
        self._trust()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear()
                outcome = Outcome.CLEARED
            elif self._remove(event.block_hashes) and outcome is Outcome.APPLIED:
                outcome = Outcome.LIE
        self.metrics.blocks.labels(self.name, self.key[1]).set(len(self.blocks))
        self._maybe_forget(now)
        return self._count(outcome)

    def _sequence(self, seq: int) -> Outcome:
        last, self.last_seq = self.last_seq, seq
        if last is None:
            self.complete = seq == 0
            return Outcome.APPLIED
        if seq <= last:  # the engine started again: it holds nothing it held
            if self.health is Health.LYING:
                self.health = Health.SILENT  # a new engine: trusted again below
            self.lies = 0
            self._clear()
            self.complete = seq == 0
            return Outcome.RESTARTED
        if seq > last + 1:
            self.complete = False
            return Outcome.GAP
        return Outcome.APPLIED

    def _store(self, hashes: Iterable[int]) -> None:
        blocks = self.blocks
        for block_hash in hashes:
            blocks[block_hash] = None
        while len(blocks) > self.limits.max_blocks:
            del blocks[next(iter(blocks))]
            self.complete = False  # a removal of a dropped one is not a lie

    def _remove(self, hashes: Iterable[int]) -> bool:
        """Whether the removal named blocks never stored (while every batch was seen)."""
        blocks, unknown = self.blocks, 0
        for block_hash in hashes:
            if block_hash in blocks:
                del blocks[block_hash]
            else:
                unknown += 1
        if unknown and self.complete:
            self.lies += unknown
            if self.lies > self.limits.max_lies:
                self._distrust(Health.LYING)
            return True
        if not self.blocks and self.complete and self.key[1] == "gpu":
            self.forget_pending = self.health is Health.LIVE  # it holds nothing now
        return False

    def _clear(self) -> None:
        self.blocks.clear()
        self.complete = True
        if self.key[1] == "gpu" and self.health is Health.LIVE:
            self.forget_pending = True

    def _maybe_forget(self, now: float) -> None:
        if self.forget_pending and now - self._forgot_at >= self.limits.min_forget_s:
            self.forget_pending = False
            self._forgot_at = now
            self._forget(self.key[0])

    def tick(self, now: float, serving: bool, interval: float) -> None:
        """Each scrape interval: a stream silent while its engine runs requests is distrusted;
        a forget held back by the rate limit is done."""
        quiet = now - self.last_event_at
        if (
            self.health is Health.LIVE
            and serving
            and quiet > self.limits.silent_intervals * interval
        ):
            self._distrust(Health.SILENT)
        self._maybe_forget(now)


class KvEventStreams:
    """A subscriber task per engine that names a KV events URL, kept in step with the
    deployment set (``want``) by ``run``."""

    def __init__(
        self,
        forget: Callable[[int], None],
        registry: CollectorRegistry | None = None,
        limits: KvEventLimits | None = None,
    ) -> None:
        self.forget = forget
        self.limits = limits or KvEventLimits()
        self.metrics = KvEventMetrics(registry)
        self.wanted: dict[StreamKey, tuple[str, str]] = {}  # key -> (url, replica name)
        self.trackers: dict[StreamKey, KvEventTracker] = {}
        self._tasks: dict[StreamKey, tuple[str, asyncio.Task[None]]] = {}

    def want(self, streams: dict[StreamKey, tuple[str, str]]) -> None:
        """The streams of the deployment set now; ``run`` starts and stops the tasks."""
        self.wanted = streams

    def trusted(self, key: StreamKey) -> bool:
        tracker = self.trackers.get(key)
        return tracker is not None and tracker.health is Health.LIVE

    async def run(
        self, interval: Callable[[], float], serving: Callable[[StreamKey], bool]
    ) -> None:
        try:
            while True:
                self._reconcile()
                now, period = time.monotonic(), interval()
                for key, tracker in list(self.trackers.items()):
                    tracker.tick(now, serving(key), period)
                await asyncio.sleep(period)
        finally:
            await self.close()

    def _reconcile(self) -> None:
        for key, (url, task) in list(self._tasks.items()):
            if self.wanted.get(key, ("",))[0] != url:
                task.cancel()
                del self._tasks[key]
                tracker = self.trackers.pop(key)
                self.metrics.remove(tracker.name, key[1])
        for key, (url, name) in self.wanted.items():
            if key not in self._tasks:
                tracker = KvEventTracker(
                    key, name, self.limits, self.metrics, self.forget, time.monotonic()
                )
                self.trackers[key] = tracker
                task = asyncio.create_task(self._listen(url, tracker), name=f"kv-events-{key}")
                self._tasks[key] = (url, task)

    async def _listen(self, url: str, tracker: KvEventTracker) -> None:
        import zmq
        import zmq.asyncio

        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(url)
            log.info("reading KV events of %s %s at %s", tracker.name, tracker.key[1], url)
            while True:
                frames = await sock.recv_multipart()
                now = time.monotonic()
                if tracker.receive(frames, now) is Outcome.FLOOD:
                    await asyncio.sleep(tracker.flood_pause(now))
        except zmq.ZMQError as exc:
            log.warning("KV events of %s at %s: %s", tracker.name, url, exc)
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        for _, task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
