"""A goodput sweep against one live target: every rate of the plan, then the bisection.

Shared by ``syshax benchmark --request-rate 1,2,4`` and the control plane's benchmark runs
(``controlplane/benchmarks/measure.py``), so both record the same rows and the same search.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from loadgen.client import StreamClient
from loadgen.goodput import DEFAULT_ATTAINMENT, GoodputSearch, RatePoint
from loadgen.records import RequestRecord
from loadgen.report import Row
from loadgen.runner import LoadSpec, run_load
from loadgen.stats import SLO, summarize
from loadgen.targets import Target
from loadgen.workload import WARMUP_INDEX, build_requests

OnDone = Callable[[RequestRecord], None]
# Called as each rate starts with (mode, rate, requests); returns the per-request callback
# for that rate and a callable run when the rate ends (a progress bar's update and close).
Closer = Callable[[], None]
Progress = Callable[[str, float, int], tuple[OnDone | None, Closer | None]]


@dataclass(frozen=True)
class SweepPlan:
    rates: tuple[float, ...]
    slo: SLO
    iterations: int
    input_tokens: int
    output_tokens: int
    cap: int | None = None  # most requests in flight; None: open loop, uncapped
    attainment: float = DEFAULT_ATTAINMENT
    bisections: int = 0
    warmup: int = 1
    seed: int = 0
    burstiness: float = 1.0
    sim_speed: float = 1.0  # the targets are simulators at this --speed

    def most_requests(self, targets: int) -> int:
        """Requests the plan can send at most (every listed rate and every bisection)."""
        return self.iterations * (len(self.rates) + self.bisections) * targets


async def sweep_target(
    client: StreamClient,
    target: Target,
    model: str,
    plan: SweepPlan,
    *,
    progress: Progress | None = None,
    busy_poll: bool = False,
) -> tuple[GoodputSearch, list[Row]]:
    """Measure ``target`` at each rate of the plan until its search is done."""
    search = GoodputSearch(plan.rates, target=plan.attainment, bisections=plan.bisections)
    rows: list[Row] = []
    # The same prompts at every rate and mode, so the rates compare like for like.
    specs = build_requests(
        plan.iterations, plan.input_tokens, plan.output_tokens, plan.seed * 1_000_003
    )
    warmup = build_requests(
        plan.warmup,
        plan.input_tokens,
        plan.output_tokens,
        plan.seed * 1_000_003 + 1,
        first_index=WARMUP_INDEX,
    )
    while (rate := search.next_rate()) is not None:
        on_done, finished = progress(target.mode, rate, len(specs)) if progress else (None, None)
        began = time.time()
        try:
            # The plan's rates are in simulated time when the targets are simulators.
            result = await run_load(
                client,
                specs,
                LoadSpec(plan.cap, rate * plan.sim_speed, plan.burstiness, plan.seed),
                warmup=warmup,
                on_done=on_done,
                busy_poll=busy_poll,
            )
        finally:
            if finished is not None:
                finished()
        records = [record.scaled(plan.sim_speed) for record in result.records]
        summary = summarize(records, result.duration_s * plan.sim_speed, plan.slo)
        search.record(
            RatePoint(
                rate=rate,
                requests=summary.requests,
                good=summary.good_requests or 0,
                duration_s=summary.duration_s,
                output_tokens=summary.total_output_tokens,
                bisection=rate not in plan.rates,
            )
        )
        rows.append(
            Row(
                target.mode,
                plan.cap or 0,
                target.url,
                model,
                summary,
                records,
                window=(began, time.time()),
                rate=rate,
            )
        )
    return search, rows
