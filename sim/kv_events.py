"""The simulator's KV events publisher: vLLM's ``--kv-events-config`` on a ZMQ PUB socket.

The engine loop hands each step's recorded events to ``publish``, which only puts them on a
bounded queue: a thread turns them into vLLM's structs, encodes and sends them, numbering the
batches from 0 and keeping the last ``buffer_steps`` for the replay socket, as vLLM's
``ZmqEventPublisher`` does. vLLM's ``publish`` blocks when its queue is full; here a full queue
drops the batch and counts it (``dropped_total``) instead, so a stuck socket never stalls the
modelled timeline.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from common.kv_events import (
    END_SEQ,
    MEDIUM_GPU,
    SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
    external_hash,
)

log = logging.getLogger("sim")
# vLLM's KVCacheSpecKind of the one KV cache group a decoder-only model has.
FULL_ATTENTION = "full_attention"
# A recorded prefix cache event (sim/prefix_cache.py): ("stored", hashes, parent, token ids),
# ("removed", hashes, None, ()) or ("cleared", [], None, ()).
RecordedEvent = tuple[str, list[int], int | None, Sequence[int]]


def wire_events(recorded: Sequence[RecordedEvent], block_size: int) -> list[KVCacheEvent]:
    """The prefix cache's recorded events as vLLM's structs: hashes made unsigned 64-bit."""
    events: list[KVCacheEvent] = []
    for kind, hashes, parent, token_ids in recorded:
        if kind == "stored":
            events.append(
                BlockStored(
                    block_hashes=[external_hash(h) for h in hashes],
                    parent_block_hash=None if parent is None else external_hash(parent),
                    token_ids=list(token_ids),
                    block_size=block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=[None] * len(hashes),
                    group_idx=0,
                    kv_cache_spec_kind=FULL_ATTENTION,
                )
            )
        elif kind == "removed":
            events.append(
                BlockRemoved(
                    block_hashes=[external_hash(h) for h in hashes], medium=MEDIUM_GPU, group_idx=0
                )
            )
        else:
            events.append(AllBlocksCleared())
    return events


class KvEventPublisher:
    """PUB (and, if configured, ROUTER replay) sockets served by one thread."""

    POLL_S = 0.1

    def __init__(
        self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.dropped_total = 0
        self.published_total = 0
        self._queue: queue.Queue[tuple[float, Sequence[RecordedEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _open(self._pub, config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV events on %s (topic %r)", self.endpoint, config.topic)

    def publish(self, recorded: Sequence[RecordedEvent], ts: float | None = None) -> None:
        """Queue one step's events; never blocks (a full queue drops them, counted)."""
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, recorded))
        except queue.Full:
            self.dropped_total += 1

    def describe(self) -> dict[str, object]:
        """For ``/sim/info``: where it publishes, and what it sent and dropped."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.config.replay_endpoint,
            "topic": self.config.topic,
            "published_total": self.published_total,
            "dropped_total": self.dropped_total,
        }

    def close(self) -> None:
        self._running = False
        # A full queue: the thread sees _running is False within one poll.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=1.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while self._running:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                continue
            if item is None:
                break
            ts, recorded = item
            events = wire_events(recorded, self.block_size)
            payload = encode(KVEventBatch(ts, events, self.data_parallel_rank))
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload))
            except zmq.ZMQError as exc:
                log.warning("KV events batch %d not sent: %s", seq, exc)
            self._replay_buffer.append((seq, payload))
            self.published_total += 1
            seq += 1

    def _serve_replay(self) -> None:
        """A replay request ``(identity, "", start seq)``: every kept batch from that seq,
        then the end marker, as vLLM answers."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._replay_buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _open(socket: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind a wildcard, ipc or inproc endpoint, connect to any other (vLLM's rule); a bound
    ``tcp://*:0`` reports the port it got."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
        bound = socket.getsockopt(zmq.LAST_ENDPOINT)
        return bound.decode() if isinstance(bound, bytes) else endpoint
    socket.connect(endpoint)
    return endpoint
