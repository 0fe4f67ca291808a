"""Mixed traffic in virtual time: interactive requests beside batch requests, per SLO class.

``scripts/bench/mixed_traffic.py`` is the command; docs/benchmarks.md ("Mixed traffic") has
its table. The question is the issue's: with the interactive rate held at what the GPU alone
serves at 99 % of its SLO, how much batch work can each mode carry before interactive
traffic falls below 99 %? Three modes on the same engines, every engine scheduling by
priority (vLLM's ``--scheduling-policy priority``, interactive first):

- ``gpu``: the GPU alone, batch requests queued behind interactive ones and preempted first.
- ``class-blind``: hetero with the default decider, every request judged alike
  (``class_aware`` off), though the engines still schedule by the class's priority.
- ``class-aware``: hetero judging each request by its class (``class_aware`` on): a batch
  decode goes to the CPU whenever the CPU's measured ITL meets the batch TPOT target.

A run offers batch requests from time 0 and interactive requests after a warm-up, for a
window of ``requests / interactive rate`` seconds, with batch arrivals going on to its end:
the CPU's batch has filled before the first interactive request is measured. Requests go
through the router's flow control (``hetero.virtual``): a batch request the decider answers
with a 429 waits in the router's queue, and is shed past its TTFT target, so the batch load
offered may exceed what is served. What a mode carries is measured as it is served: the
batch tokens delivered within the measured window, of batch requests that completed within
the batch class's own targets, per second of the window (``ClassFigures.window_good_tokens``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from common.policy_schema import PolicyKnobs
from hetero.sweep import Pair, default_rates, pair_knobs
from hetero.virtual import Request, RunStats, VirtualDeployment
from loadgen.goodput import BISECTION_TOLERANCE, GoodputSearch, RatePoint
from loadgen.scenarios import MixedScenario
from loadgen.stats import SLO, percentile
from loadgen.workload import arrival_offsets
from sim.perfmodel import decode_step_time, effective_hardware

MIXED_MODES = ("gpu", "class-blind", "class-aware")
# The batch class's TPOT target as a multiple of the interactive one (the pair's SLO): the
# low end of the "five or ten times slower". On both pairs it lets the CPU engine
# run its whole batch (max_num_seqs 64: a 290 ms step on the Kunpeng, 66-93 ms on the Xeon,
# against 750 and 500 ms), so a looser target would change nothing; a tighter one would only
# cap the Kunpeng's batch where its throughput is already flat (compute-bound past ~20).
BATCH_TPOT_FACTOR = 5.0
# Interactive traffic must meet its SLO for this share of its requests (the target).
INTERACTIVE_ATTAINMENT = 99.0
# Batch rates tried, as multiples of the CPU engine's estimated batch capacity
# (``cpu_batch_capacity``); the search stops at the first that misses, then bisects.
BATCH_LADDER = (0.0625, 0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
# A batch stream seeded apart from the interactive one.
BATCH_SEED_OFFSET = 7919


def mixed_knobs(pair: Pair, mode: str) -> PolicyKnobs:
    """The policy of ``mode`` with the classes' targets set from the pair: interactive at
    the pair's SLO, batch at ``BATCH_TPOT_FACTOR`` times its TPOT (TTFT: the class
    default, 60 s), so the decider judges the CPU by the same targets the benchmark scores."""
    if mode not in MIXED_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MIXED_MODES)}")
    base = pair_knobs(pair, "gpu" if mode == "gpu" else "hetero")
    return replace(
        base,
        class_aware=mode == "class-aware",
        interactive_ttft_ms=pair.slo_ttft_ms,
        interactive_tpot_ms=pair.slo_tpot_ms,
        batch_tpot_ms=BATCH_TPOT_FACTOR * pair.slo_tpot_ms,
    )


def mixed_deployment(
    pair: Pair,
    mode: str,
    knobs: PolicyKnobs | None = None,
    window: tuple[float, float] | None = None,
) -> VirtualDeployment:
    """The pair's engines for ``mode``, both scheduling by priority; requests count the
    tokens they receive within ``window`` (seconds from the start)."""
    knobs = knobs or mixed_knobs(pair, mode)
    gpu = replace(pair.gpu, scheduling_policy="priority")
    cpu = None if mode == "gpu" else replace(pair.cpu, scheduling_policy="priority")
    return VirtualDeployment(gpu, cpu, knobs, window=window)


def class_slo(knobs: PolicyKnobs, slo_class: str) -> SLO:
    target = knobs.slo_class(slo_class)
    return SLO(target.ttft_ms, target.tpot_ms)


@dataclass(frozen=True)
class MixedLoad:
    """The offered load of one run."""

    interactive_rate: float
    batch_rate: float
    window_s: float  # interactive arrivals span this long, after the warm-up
    warmup_s: float  # batch arrivals only, before the window

    @property
    def span_s(self) -> float:
        """How long batch requests arrive: warm-up and window."""
        return self.warmup_s + self.window_s


def warmup_seconds(pair: Pair, traffic: MixedScenario) -> float:
    """The time one batch request takes at the batch TPOT target: by then the CPU's batch
    has filled to its steady state at any batch rate the CPU sustains."""
    batch = traffic.for_class("batch")
    return batch.output_tokens * BATCH_TPOT_FACTOR * pair.slo_tpot_ms / 1000.0


def mixed_requests(traffic: MixedScenario, load: MixedLoad, seed: int) -> list[Request]:
    """Both classes' requests in arrival order (Poisson streams of their own seeds)."""
    interactive = traffic.for_class("interactive")
    batch = traffic.for_class("batch")
    arrivals: list[tuple[float, str, int, int]] = []
    count = max(1, round(load.interactive_rate * load.window_s))
    for at in arrival_offsets(count, load.interactive_rate, 1.0, seed):
        arrivals.append(
            (load.warmup_s + at, "interactive", interactive.input_tokens, interactive.output_tokens)
        )
    if load.batch_rate > 0:
        count = round(load.batch_rate * load.span_s)
        for at in arrival_offsets(count, load.batch_rate, 1.0, seed + BATCH_SEED_OFFSET):
            arrivals.append((at, "batch", batch.input_tokens, batch.output_tokens))
    arrivals.sort(key=lambda a: a[0])
    return [
        Request(i, prompt, output, at, slo_class=name)
        for i, (at, name, prompt, output) in enumerate(arrivals)
    ]


@dataclass(frozen=True)
class ClassFigures:
    """One class's requests in one run."""

    requests: int
    completed: int
    good: int  # completed within the class's TTFT and TPOT targets
    tokens: int  # output tokens of completed requests
    good_tokens: int  # output tokens of good requests
    cpu_tokens: int  # of ``tokens``, decoded on the CPU engine
    tokens_per_s: float  # ``tokens`` per second of offered load
    good_tokens_per_s: float
    queued: int  # requests that waited in the router's queue (and left it, routed or shed)
    shed: int  # requests the router's flow control turned away (a 429 after or without a wait)
    # Output tokens good requests received within the measured window (the interactive
    # window), and per second of it: the rate the class was served at there.
    window_good_tokens: int
    window_good_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None

    @property
    def attainment(self) -> float:
        return 100.0 * self.good / self.requests if self.requests else 100.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "attainment": self.attainment}


def class_figures(
    requests: list[Request], slo: SLO, span_s: float, window_s: float
) -> ClassFigures:
    """``requests`` (one class's) against ``slo``: per second of offered load (``span_s``,
    the span their arrivals were drawn over) and of the measured window (``window_s``)."""
    done = [r for r in requests if r.ok]
    good = [r for r in done if slo.met_by(r)]
    ttfts = [1000.0 * r.ttft for r in done if r.ttft is not None]
    tpots = [1000.0 * r.tpot for r in done if r.tpot is not None]

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    tokens = sum(r.tokens for r in done)
    good_tokens = sum(r.tokens for r in good)
    window_good = sum(r.window_tokens for r in good)
    return ClassFigures(
        requests=len(requests),
        completed=len(done),
        good=len(good),
        tokens=tokens,
        good_tokens=good_tokens,
        cpu_tokens=sum(r.cpu_tokens for r in done),
        tokens_per_s=tokens / span_s if span_s > 0 else 0.0,
        good_tokens_per_s=good_tokens / span_s if span_s > 0 else 0.0,
        queued=sum(1 for r in requests if r.queued_s > 0),
        shed=sum(1 for r in requests if r.error is not None and r.error.startswith("429")),
        window_good_tokens=window_good,
        window_good_tokens_per_s=window_good / window_s if window_s > 0 else 0.0,
        ttft_p50_ms=pct(ttfts, 50),
        ttft_p99_ms=pct(ttfts, 99),
        tpot_p50_ms=pct(tpots, 50),
        tpot_p99_ms=pct(tpots, 99),
    )


@dataclass
class MixedPoint:
    """One mode at one batch rate."""

    load: MixedLoad
    interactive: ClassFigures
    batch: ClassFigures
    decisions: dict[str, int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)

    def meets(self, target: float = INTERACTIVE_ATTAINMENT) -> bool:
        return self.interactive.attainment >= target

    def to_dict(self) -> dict[str, object]:
        return {
            "load": asdict(self.load),
            "interactive": self.interactive.to_dict(),
            "batch": self.batch.to_dict(),
            "decisions": self.decisions,
            "preemptions": self.preemptions,
        }


def measure_mixed(
    pair: Pair, traffic: MixedScenario, mode: str, load: MixedLoad, *, seed: int = 0
) -> tuple[MixedPoint, RunStats]:
    knobs = mixed_knobs(pair, mode)
    window = (load.warmup_s, load.span_s)
    deployment = mixed_deployment(pair, mode, knobs, window)
    stats = deployment.run_requests(mixed_requests(traffic, load, seed))
    by_class: dict[str, list[Request]] = {"interactive": [], "batch": []}
    for r in stats.requests:
        by_class[r.slo_class or "interactive"].append(r)
    point = MixedPoint(
        load=load,
        interactive=class_figures(
            by_class["interactive"], class_slo(knobs, "interactive"), load.window_s, load.window_s
        ),
        batch=class_figures(
            by_class["batch"], class_slo(knobs, "batch"), load.span_s, load.window_s
        ),
        decisions=dict(Counter(stats.decisions).most_common()),
        preemptions=dict(stats.preemptions),
    )
    return point, stats


def interactive_rate(
    pair: Pair,
    traffic: MixedScenario,
    *,
    requests: int,
    seed: int = 0,
    rates: tuple[float, ...] | None = None,
    bisections: int = 4,
    target: float = INTERACTIVE_ATTAINMENT,
) -> GoodputSearch:
    """GPU-only's max goodput on interactive traffic alone at ``target`` attainment (the
    existing bisection, ``GoodputSearch``): the interactive rate every mode is held at."""
    shape = traffic.for_class("interactive")
    search = GoodputSearch(
        rates or default_rates(pair, shape), target=target, bisections=bisections
    )
    while (rate := search.next_rate()) is not None:
        load = MixedLoad(rate, 0.0, requests / rate, 0.0)
        point, stats = measure_mixed(pair, traffic, "gpu", load, seed=seed)
        figures = point.interactive
        search.record(
            RatePoint(
                rate=rate,
                requests=figures.requests,
                good=figures.good,
                duration_s=stats.duration_s,
                output_tokens=figures.tokens,
                bisection=rate not in search.rates,
            )
        )
    return search


def cpu_batch_capacity(pair: Pair, traffic: MixedScenario) -> float:
    """Batch requests/s the CPU engine decodes at most within the batch TPOT target, from the
    presets: its largest batch within the target (and max_num_seqs) over that step's time,
    divided by a batch request's output tokens. Where the batch search starts its ladder."""
    shape = traffic.for_class("batch")
    hw = effective_hardware(pair.cpu.device)
    context = shape.input_tokens + shape.output_tokens // 2
    target = BATCH_TPOT_FACTOR * pair.slo_tpot_ms / 1000.0
    best = 0.0
    for batch in range(1, pair.cpu.max_num_seqs + 1):
        step = decode_step_time(hw, pair.cpu.model, batch, context)
        if step > target:
            break
        best = max(best, batch / step)
    return best / shape.output_tokens


@dataclass
class BatchSearch:
    """The highest batch rate at which interactive traffic met its target, every lower rate
    tried meeting it too: up a ladder until the first miss, then bisection."""

    mode: str
    points: list[MixedPoint] = field(default_factory=list)
    target: float = INTERACTIVE_ATTAINMENT

    @property
    def best(self) -> MixedPoint | None:
        passing = [p for p in self.points if p.meets(self.target)]
        failing = [p.load.batch_rate for p in self.points if not p.meets(self.target)]
        limit = min(failing, default=math.inf)
        below = [p for p in passing if p.load.batch_rate < limit]
        return max(below, key=lambda p: p.load.batch_rate, default=None)

    def to_dict(self) -> dict[str, object]:
        best = self.best
        return {
            "mode": self.mode,
            "target": self.target,
            "best_batch_rate": best.load.batch_rate if best else 0.0,
            "points": [p.to_dict() for p in sorted(self.points, key=lambda p: p.load.batch_rate)],
        }


def batch_search(
    pair: Pair,
    traffic: MixedScenario,
    mode: str,
    interactive: float,
    *,
    requests: int,
    seed: int = 0,
    ladder: tuple[float, ...] | None = None,
    bisections: int = 4,
    warmup_s: float | None = None,
    target: float = INTERACTIVE_ATTAINMENT,
) -> BatchSearch:
    """Find ``mode``'s highest batch rate with ``interactive`` req/s of interactive traffic
    (``requests`` of them) meeting its SLO for ``target`` % of requests."""
    if ladder is None:
        capacity = cpu_batch_capacity(pair, traffic)
        ladder = tuple(round(capacity * f, 4) for f in BATCH_LADDER)
    warmup = warmup_seconds(pair, traffic) if warmup_s is None else warmup_s
    window = requests / interactive
    search = BatchSearch(mode, target=target)

    def run(rate: float) -> bool:
        load = MixedLoad(interactive, rate, window, warmup)
        point, _ = measure_mixed(pair, traffic, mode, load, seed=seed)
        search.points.append(point)
        return point.meets(target)

    low, high = 0.0, None
    for rate in ladder:
        if not run(rate):
            high = rate
            break
        low = rate
    for _ in range(bisections if high is not None else 0):
        assert high is not None
        if high - low <= BISECTION_TOLERANCE * high:
            break
        middle = round((low + high) / 2, 5)
        if run(middle):
            low = middle
        else:
            high = middle
    return search


@dataclass
class MixedResult:
    """One pair, one seed: the interactive rate and each mode's batch search."""

    pair: str
    seed: int
    interactive: GoodputSearch
    searches: dict[str, BatchSearch]

    def to_dict(self) -> dict[str, object]:
        return {
            "pair": self.pair,
            "seed": self.seed,
            "interactive_rate": self.interactive.max_goodput_rate,
            "interactive_search": self.interactive.to_dict(),
            "modes": {mode: s.to_dict() for mode, s in self.searches.items()},
        }


def run_mixed(
    pair: Pair,
    traffic: MixedScenario,
    *,
    requests: int,
    seed: int = 0,
    modes: tuple[str, ...] = MIXED_MODES,
    interactive_rates: tuple[float, ...] | None = None,
    ladder: tuple[float, ...] | None = None,
    bisections: int = 4,
    warmup_s: float | None = None,
) -> MixedResult:
    """The whole benchmark for one pair and seed, in one process (the script spreads the
    modes over processes with ``interactive_rate`` and ``batch_search`` itself)."""
    search = interactive_rate(
        pair, traffic, requests=requests, seed=seed, rates=interactive_rates, bisections=bisections
    )
    rate = search.max_goodput_rate
    if rate is None:
        raise ValueError(f"{pair.name}: GPU-only met no interactive rate ({search.verdict()})")
    searches = {
        mode: batch_search(
            pair,
            traffic,
            mode,
            rate,
            requests=requests,
            seed=seed,
            ladder=ladder,
            bisections=bisections,
            warmup_s=warmup_s,
        )
        for mode in modes
    }
    return MixedResult(pair.name, seed, search, searches)


def median_seed(results: list[MixedResult], mode: str) -> MixedResult:
    """The seed whose ``mode`` carried the median batch tokens/s (the lower middle of an
    even count), so a row's figures all come from one run."""
    ranked = sorted(results, key=lambda r: (batch_tokens_per_s(r, mode), r.seed))
    return ranked[(len(ranked) - 1) // 2]


def batch_tokens_per_s(result: MixedResult, mode: str) -> float:
    """What ``mode`` carried at its highest batch rate with interactive traffic at target:
    the batch class's good tokens per second of the measured window."""
    best = result.searches[mode].best
    return best.batch.window_good_tokens_per_s if best is not None else 0.0


def ratio(top: float, base: float) -> float:
    """``top / base``; infinite where the base carried nothing and the top something."""
    if base > 0:
        return top / base
    return math.inf if top > 0 else 1.0


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
