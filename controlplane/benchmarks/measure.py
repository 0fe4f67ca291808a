"""Run a BenchmarkRun's load with the load generator (loadgen) and collect its rows.

Runs inside a Celery worker. The load is asyncio; the database is touched only from a
thread (``sync_to_async``), once a second, to publish progress and read a cancel request.
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


Report = Callable[[int, int], Awaitable[bool]]  # (done, total) -> keep going?


async def measure(
    plan: Plan,
    report: Report,
    interval_s: float = 1.0,
    sweeps: dict[str, GoodputSearch] | None = None,
) -> list[Row]:
    """Every (level, mode) row of the plan, or every (mode, rate) row of its sweep, whose
    searches go into ``sweeps``. ``report`` is awaited about once a second; when it returns
    False the run stops with ``Cancelled``."""
    done = 0
    total = plan.total_requests
    rows: list[Row] = []

    def count(_: object) -> None:
        nonlocal done
        done += 1

    async def watch(task: asyncio.Task[None]) -> None:
        while not task.done():
            if not await report(done, total):
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
                    for target in plan.targets():
                        client = client_for(target)
                        search, target_rows = await sweep_target(
                            client,
                            target,
                            model,
                            plan.sweep,
                            progress=lambda _mode, _rate, _n: (count, None),
                        )
                        if sweeps is not None:
                            sweeps[target.mode] = search
                        rows.extend(target_rows)
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
                        began = time.time()
                        result = await run_load(
                            client,
                            specs,
                            LoadSpec(level, math.inf, 1.0, plan.seed),
                            warmup=warmup,
                            on_done=count,
                        )
                        summary = summarize(result.records, result.duration_s)
                        rows.append(
                            Row(
                                target.mode,
                                level,
                                target.url,
                                model,
                                summary,
                                result.records,
                                window=(began, time.time()),
                            )
                        )
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
