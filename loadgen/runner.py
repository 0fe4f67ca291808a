"""Drive a set of requests against one target: closed-loop concurrency or an arrival rate.

Warm-up requests go first, at the same concurrency, and are not recorded; the wall clock of
the measured phase starts after them, as in ``vllm bench serve``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from loadgen.client import StreamClient
from loadgen.records import RequestRecord
from loadgen.workload import RequestSpec, arrival_offsets

OnDone = Callable[[RequestRecord], None]
T = TypeVar("T")


@dataclass(frozen=True)
class LoadSpec:
    """How to offer the load.

    ``concurrency`` caps the requests in flight (closed loop when the rate is infinite);
    None leaves it uncapped, which only makes sense with a finite rate.
    """

    concurrency: int | None
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.concurrency is None and math.isinf(self.request_rate):
            raise ValueError("an infinite request rate needs a concurrency cap")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("request rate and burstiness must be positive")

    def to_dict(self) -> dict[str, object]:
        return {
            "concurrency": self.concurrency,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "burstiness": self.burstiness,
            "seed": self.seed,
        }


@dataclass
class RunResult:
    """The measured requests of one run, in request order."""

    records: list[RequestRecord]
    duration_s: float
    # Epoch seconds = perf_counter seconds + wall_offset (sampled once, at the start).
    wall_offset: float
    started_at: float


async def _closed_loop(
    client: StreamClient, specs: Sequence[RequestSpec], concurrency: int, on_done: OnDone | None
) -> list[RequestRecord]:
    """``concurrency`` workers, each sending its next request as soon as the last one ends."""
    pending = iter(specs)
    records: list[RequestRecord] = []

    async def worker() -> None:
        for spec in pending:  # the iterator is shared, so each spec goes to one worker
            record = await client.send(spec)
            records.append(record)
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return records


async def _open_loop(
    client: StreamClient, specs: Sequence[RequestSpec], load: LoadSpec, on_done: OnDone | None
) -> list[RequestRecord]:
    """Send at precomputed arrival times, holding back only when the cap is reached."""
    offsets = arrival_offsets(len(specs), load.request_rate, load.burstiness, load.seed)
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency is not None else None
    records: list[RequestRecord] = []

    async def one(spec: RequestSpec, due: float) -> None:
        if cap is None:
            record = await client.send(spec)
        else:
            async with cap:
                record = await client.send(spec)
        record.due_at = due
        records.append(record)
        if on_done is not None:
            on_done(record)

    start = time.perf_counter()
    tasks = []
    for spec, offset in zip(specs, offsets, strict=True):
        due = start + offset
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec, due)))
    await asyncio.gather(*tasks)
    return records


async def _spin(stop: asyncio.Event) -> None:
    """Keep the event loop polling instead of sleeping in the kernel.

    A loop blocked in epoll must be woken when a chunk arrives; on a virtual machine that
    wake-up alone can cost milliseconds. Spinning costs a whole core, so it is opt-in.
    """
    while not stop.is_set():  # noqa: ASYNC110 - polling is the point
        await asyncio.sleep(0)


def use_realtime_priority(priority: int = 10) -> str | None:
    """Run this process at SCHED_FIFO priority, for timing on a machine shared with others.

    A real-time process preempts ordinary ones the moment its socket becomes readable, so a
    chunk is stamped when it arrives rather than when the scheduler next gets round to the
    generator. The generator sleeps between reads, so it takes little CPU from anyone; do not
    combine this with busy-polling, which would hold the core. Children go back to the
    ordinary policy (SCHED_RESET_ON_FORK). Returns None, or why it was not possible.
    """
    if not hasattr(os, "SCHED_FIFO"):
        return "this platform has no SCHED_FIFO"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(priority))
    except OSError as exc:
        return f"cannot use SCHED_FIFO: {exc.strerror or exc}"
    return None


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed: its per-read cost is a fraction of the
    pure-Python loop's, which matters when hundreds of streams deliver chunks at once."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


async def run_load(
    client: StreamClient,
    specs: Sequence[RequestSpec],
    load: LoadSpec,
    *,
    warmup: Sequence[RequestSpec] = (),
    on_done: OnDone | None = None,
    busy_poll: bool = False,
) -> RunResult:
    """Warm up, then send ``specs`` as ``load`` says and record every one of them."""
    if warmup:
        await _closed_loop(client, warmup, load.concurrency or len(warmup), None)
    stop = asyncio.Event()
    spinner = asyncio.create_task(_spin(stop)) if busy_poll else None
    wall_offset = time.time() - time.perf_counter()
    started = time.perf_counter()
    try:
        if math.isinf(load.request_rate) and load.concurrency is not None:
            records = await _closed_loop(client, specs, load.concurrency, on_done)
        else:
            records = await _open_loop(client, specs, load, on_done)
    finally:
        stop.set()
        if spinner is not None:
            await spinner
    duration = time.perf_counter() - started
    records.sort(key=lambda record: record.index)
    return RunResult(records, duration, wall_offset, started + wall_offset)
