"""Run a BenchmarkRun's load with the load generator (loadgen) and collect its rows.

Runs inside a Celery worker. The load is asyncio; the database is touched only from a
thread (``sync_to_async``): once a second to publish progress and read a cancel request,
when a point starts (its phase) and when it finishes (its row, stored at once).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loadgen.client import StreamClient, discover_model, make_session
from loadgen.goodput import GoodputSearch
from loadgen.report import Row
from loadgen.runner import LoadSpec, run_load
from loadgen.stats import summarize
from loadgen.sweeping import SweepPlan, sweep_target
from loadgen.targets import Target, plan_targets
from loadgen.wire import ConnectionPool
from loadgen.workload import WARMUP_INDEX, build_requests


class Cancelled(Exception):
    pass


@dataclass(frozen=True)
class Plan:
    url: str
    mode: str
    levels: list[int]
    iterations: int
    warmup: int
    seed: int
    input_tokens: int
    output_tokens: int
    timeout_s: float = 600.0
    api_key: str = ""  # sent as 'Authorization: Bearer' (a router's key; empty: none)
    sweep: SweepPlan | None = None  # a goodput sweep instead of the concurrency levels

    def targets(self) -> list[Target]:
        return plan_targets(self.mode, self.url, {})

    @property
    def total_requests(self) -> int:
        if self.sweep is not None:
            return self.sweep.most_requests(len(self.targets()))
        return self.iterations * len(self.levels) * len(self.targets())

    @property
    def points_total(self) -> int:
        """The rows the run measures: one per level and mode, or per rate and mode of a
        sweep (a bisection may add a few; the count then grows as they start)."""
        if self.sweep is not None:
            return len(self.sweep.rates) * len(self.targets())
        return len(self.levels) * len(self.targets())


Report = Callable[[int, int], Awaitable[bool]]  # (done, total) -> keep going?


@dataclass(frozen=True)
class Point:
    """One row about to be measured: its mode, its level (or a sweep's rate), its place."""

    mode: str
    concurrency: int
    rate: float | None
    index: int  # 1-based
    total: int
    warmup: int  # warm-up requests sent before it is timed

    @property
    def label(self) -> str:
        where = f"{self.rate:g} req/s" if self.rate is not None else f"c={self.concurrency}"
        return f"{self.mode} {where} ({self.index} of {self.total} points)"


async def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the runner hears: ``report`` about once a second (False stops the run),
    ``started`` when a point begins, ``finished`` with each point's row as soon as it ends."""

    report: Report
    started: Callable[[Point], Awaitable[None]] = _nothing
    finished: Callable[[Row], Awaitable[None]] = _nothing


async def measure(
    plan: Plan,
    hooks: Hooks,
    interval_s: float = 1.0,
    sweeps: dict[str, GoodputSearch] | None = None,
) -> list[Row]:
    """Every (level, mode) row of the plan, or every (mode, rate) row of its sweep, whose
    searches go into ``sweeps``. ``hooks.report`` is awaited about once a second; when it
    returns False the run stops with ``Cancelled`` (the rows already handed to
    ``hooks.finished`` stay the runner's)."""
    done = 0
    total = plan.total_requests
    rows: list[Row] = []
    report = hooks.report
    points = plan.points_total
    started = 0
    pending: set[asyncio.Future[None]] = set()  # a sweep's point announcements in flight

    async def begin(mode: str, concurrency: int, rate: float | None, warmup: int) -> None:
        nonlocal started, points
        started += 1
        points = max(points, started)
        await hooks.started(Point(mode, concurrency, rate, started, points, warmup))

    def count(_: object) -> None:
        nonlocal done
        done += 1

    storing = asyncio.Lock()  # a cancel waits for a finished point to be stored whole

    async def finished(row: Row) -> None:
        rows.append(row)
        async with storing:
            await hooks.finished(row)

    async def watch(task: asyncio.Task[None]) -> None:
        while not task.done():
            if not await report(done, total):
                async with storing:
                    task.cancel()
                return
            await asyncio.sleep(interval_s)

    async def work() -> None:
        pool = ConnectionPool()
        try:
            async with make_session() as session:
                auth = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
                model = await discover_model(session, plan.url, auth)

                def client_for(target: Target) -> StreamClient:
                    return StreamClient(
                        pool,
                        target.url,
                        model,
                        headers={**target.headers, **auth},
                        timeout_s=plan.timeout_s,
                    )

                if plan.sweep is not None:
                    sweep = plan.sweep
                    for target in plan.targets():
                        client = client_for(target)

                        def progress(
                            mode: str, rate: float, _n: int
                        ) -> tuple[Callable[[object], None], None]:
                            # sweep_target calls this as each rate starts, on the loop.
                            pending.add(
                                asyncio.ensure_future(
                                    begin(mode, sweep.cap or 0, rate, sweep.warmup)
                                )
                            )
                            return count, None

                        search, target_rows = await sweep_target(
                            client, target, model, sweep, progress=progress
                        )
                        if sweeps is not None:
                            sweeps[target.mode] = search
                        for row in target_rows:
                            await finished(row)
                    await asyncio.gather(*pending)
                    return
                for level in plan.levels:
                    seed = plan.seed * 1_000_003 + level
                    specs = build_requests(
                        plan.iterations, plan.input_tokens, plan.output_tokens, seed
                    )
                    warmup = build_requests(
                        plan.warmup,
                        plan.input_tokens,
                        plan.output_tokens,
                        seed + 1,
                        first_index=WARMUP_INDEX,
                    )
                    for target in plan.targets():
                        client = client_for(target)
                        await begin(target.mode, level, None, plan.warmup)
                        began = time.time()
                        result = await run_load(
                            client,
                            specs,
                            LoadSpec(level, math.inf, 1.0, plan.seed),
                            warmup=warmup,
                            on_done=count,
                        )
                        summary = summarize(result.records, result.duration_s)
                        row = Row(
                            target.mode,
                            level,
                            target.url,
                            model,
                            summary,
                            result.records,
                            window=(began, time.time()),
                        )
                        await finished(row)
        finally:
            pool.close()

    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(watch(task))
    try:
        await task
    except asyncio.CancelledError:
        raise Cancelled() from None
    finally:
        watcher.cancel()
    await report(done, total)
    return rows
