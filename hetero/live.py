"""The live matrix: each ``hetero.matrix`` scenario live and in virtual time, side by side.

For every scenario and rate, GPU-only and hetero run live (two ``syshax sim`` engines with the
KV connector, a router per mode in front of them, the project's load generator open loop, the
same requests and arrival seed for both), then the virtual model at the same settings.
``scripts/bench/live_matrix.py`` is the command; docs/benchmarks.md ("The live matrix") has
the targets ``targets`` checks.

A single-class cell compares goodput at SLO (good requests per second of offered load:
``RatePoint.goodput``). A mixed cell offers interactive requests at the scenario's
interactive rate and batch requests at the cell's rate, as ``hetero.mixed`` does (batch from
time 0, interactive after its warm-up, ``mixed_requests`` of them), and compares interactive
attainment and batch good tokens/s within the window; its modes are ``gpu`` and
``class-aware`` hetero (``hetero.mixed.mixed_knobs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from common.policy_schema import PolicyKnobs
from hetero.matrix import KNEE_ATTAINMENT, MatrixScenario, scenario_pair
from hetero.mixed import (
    BATCH_SEED_OFFSET,
    INTERACTIVE_ATTAINMENT,
    MixedLoad,
    class_slo,
    measure_mixed,
    mixed_knobs,
    warmup_seconds,
)
from hetero.sweep import Pair, measure, pair_knobs
from loadgen.client import StreamClient, discover_model, make_session
from loadgen.records import RequestRecord
from loadgen.runner import LoadSpec, run_load
from loadgen.scenarios import MIXED_SCENARIOS, SERVICE_TIERS
from loadgen.simproc import knob_flags_for_speed, running_router, running_sim
from loadgen.stats import SLO, Timed
from loadgen.wire import ConnectionPool
from loadgen.workload import WARMUP_INDEX, RequestSpec, build_requests

MODES = ("gpu", "hetero")
# The targets (docs/benchmarks.md, "The live matrix").
NO_HARM = 0.98
DECODE_HEAVY_GAIN = 1.10
MIXED_GAIN = 1.5
VIRTUAL_ERROR = 0.10
# Interactive requests in a mixed cell: its window is these over the interactive rate.
MIXED_REQUESTS = 600
BATCH_INDEX = 500_000  # batch requests' indexes, apart from interactive ones

ConnectorConfig = Callable[[str, str, Path], str]


@dataclass(frozen=True)
class Point:
    """One mode at one rate, live or virtual. Single-class: ``goodput`` is good requests/s
    and ``attainment`` its share; mixed: interactive's attainment and goodput, and the batch
    class's good tokens/s within the window."""

    requests: int
    good: int
    attainment: float
    goodput: float
    batch_tokens_per_s: float | None = None
    host_busy: float | None = None  # live: % of the host's CPU busy during the run
    # Live: the load generator's send lateness (``RequestRecord.send_lateness``), p99, in
    # simulated ms. Past a few % of the TTFT target the client, not the system, set the load.
    late_p99_ms: float | None = None
    # Which route served the judged requests and the decider's reason code
    # (``route:code``, e.g. ``pd:gpu-queue``; the route alone where it gave none), and why
    # those that missed did (``loadgen.stats.SLO.missed``): where a live and a
    # virtual cell differ, these say which part of the model to look at.
    routes: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)

    @property
    def figure(self) -> float:
        """What the targets compare: goodput, or batch tokens/s in a mixed cell."""
        return self.goodput if self.batch_tokens_per_s is None else self.batch_tokens_per_s


@dataclass
class Cell:
    """One scenario at one rate: each mode live (absent with ``--virtual-only``) and virtual."""

    scenario: MatrixScenario
    rate: float
    virtual: dict[str, Point]
    live: dict[str, Point] | None = None

    def side(self, which: str) -> dict[str, Point] | None:
        return self.live if which == "live" else self.virtual

    def ratio(self, which: str) -> float | None:
        points = self.side(which)
        if points is None:
            return None
        return ratio(points["hetero"].figure, points["gpu"].figure)

    def error(self) -> float | None:
        """The virtual model's largest relative error over the modes, against live."""
        if self.live is None:
            return None
        return max(relative_error(self.virtual[m].figure, self.live[m].figure) for m in MODES)

    def to_dict(self) -> dict[str, object]:
        return {
            "scenario": self.scenario.id,
            "rate": self.rate,
            "virtual": {m: asdict(p) for m, p in self.virtual.items()},
            "live": None if self.live is None else {m: asdict(p) for m, p in self.live.items()},
            "ratio_live": self.ratio("live"),
            "ratio_virtual": self.ratio("virtual"),
            "virtual_error": self.error(),
        }


def ratio(top: float, base: float) -> float:
    if base > 0:
        return top / base
    return math.inf if top > 0 else 1.0


def relative_error(predicted: float, measured: float) -> float:
    if measured > 0:
        return abs(predicted - measured) / measured
    return 0.0 if predicted == 0 else math.inf


def knobs_for(scenario: MatrixScenario, mode: str) -> PolicyKnobs:
    pair = scenario_pair(scenario)
    if scenario.mixed:
        return mixed_knobs(pair, "gpu" if mode == "gpu" else "class-aware")
    return pair_knobs(pair, mode)


def mixed_load(scenario: MatrixScenario, batch_rate: float, requests: int) -> MixedLoad:
    """``requests`` interactive requests after the warm-up, as ``hetero.mixed`` offers them."""
    assert scenario.traffic is not None and scenario.interactive_rate is not None
    traffic = MIXED_SCENARIOS[scenario.traffic]
    pair = scenario_pair(scenario)
    window = requests / scenario.interactive_rate
    return MixedLoad(scenario.interactive_rate, batch_rate, window, warmup_seconds(pair, traffic))


def virtual_point(
    scenario: MatrixScenario,
    mode: str,
    rate: float,
    *,
    requests: int,
    seed: int,
    mixed_requests: int = MIXED_REQUESTS,
) -> Point:
    pair = scenario_pair(scenario)
    if scenario.mixed:
        assert scenario.traffic is not None
        traffic = MIXED_SCENARIOS[scenario.traffic]
        mixed_mode = "gpu" if mode == "gpu" else "class-aware"
        load = mixed_load(scenario, rate, mixed_requests)
        point, stats = measure_mixed(pair, traffic, mixed_mode, load, seed=seed)
        i = point.interactive
        inter = [r for r in stats.requests if r.slo_class in (None, "interactive")]
        routes, misses = tally(
            inter,
            (_label(r.route, r.reason) for r in inter),
            class_slo(mixed_knobs(pair, mixed_mode), "interactive"),
        )
        return Point(
            i.requests, i.good, i.attainment, i.good / load.window_s,
            point.batch.window_good_tokens_per_s, routes=routes, misses=misses,
        )  # fmt: skip
    knobs = knobs_for(scenario, mode)
    rate_point, stats = measure(
        pair, scenario.scenario, mode, rate, requests=requests, seed=seed, knobs=knobs
    )
    slo = SLO(scenario.slo_ttft_ms, scenario.slo_tpot_ms)
    routes, misses = tally(stats.requests, (_label(r.route, r.reason) for r in stats.requests), slo)
    return Point(
        rate_point.requests, rate_point.good, rate_point.attainment, rate_point.goodput,
        routes=routes, misses=misses,
    )  # fmt: skip


def _label(route: str, code: str) -> str:
    return f"{route}:{code}" if code else route


def tally(
    items: Iterable[Timed], routes: Iterable[str], slo: SLO
) -> tuple[dict[str, int], dict[str, int]]:
    """Requests by route, and the missed ones by their cause (``Point.routes``/``misses``)."""
    missed = Counter(why for item in items if (why := slo.missed(item)))
    return dict(sorted(Counter(routes).items())), dict(sorted(missed.items()))


# -- live --------------------------------------------------------------------------------


def engine_args(
    pair: Pair, role: str, shm: Path, connector: ConnectorConfig, scheduling: str
) -> list[str]:
    """The simulator's flags for one engine of ``pair`` (as ``goodput_live.py``)."""
    config = pair.gpu if role == "gpu" else pair.cpu
    args = [
        "--max-num-seqs", str(config.max_num_seqs),
        "--kv-transfer-config", connector(role, "cpu" if role == "gpu" else "gpu", shm),
        "--enable-prompt-tokens-details", "--scheduling-policy", scheduling,
    ]  # fmt: skip
    if role == "cpu":
        args += ["--kv-cache-space", f"{config.kv_cache_space_gb:g}"]
        args += ["--cpu-bind", f"0-{config.device.cores - 1}"]
    return args


class LivePair:
    """A pair's two engines, started once, and one router per mode in front of them,
    restarted only when that mode's knobs change."""

    def __init__(
        self, pair: Pair, *, speed: float, connector: ConnectorConfig, scheduling: str = "fcfs"
    ) -> None:
        self.pair = pair
        self.speed = speed
        self.connector = connector
        self.scheduling = scheduling
        self._stack = contextlib.ExitStack()
        self._routers: dict[str, tuple[list[str], contextlib.ExitStack, str]] = {}
        self.gpu_url = ""
        self.cpu_url = ""

    def __enter__(self) -> LivePair:
        tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="syshax-lm-")))
        shm = tmp / "shm"
        shm.mkdir()
        urls = []
        for role, config in (("gpu", self.pair.gpu), ("cpu", self.pair.cpu)):
            args = engine_args(self.pair, role, shm, self.connector, self.scheduling)
            urls.append(
                self._stack.enter_context(
                    running_sim(
                        config.device.name, config.model.name, speed=self.speed, extra_args=args
                    )
                )
            )
        self.gpu_url, self.cpu_url = urls
        return self

    def __exit__(self, *exc: object) -> None:
        for _, stack, _ in self._routers.values():
            stack.close()
        self._routers.clear()
        self._stack.close()

    def router(self, mode: str, knobs: PolicyKnobs) -> str:
        flags = knob_flags_for_speed(knobs, self.speed)
        held = self._routers.get(mode)
        if held is not None and held[0] == flags:
            return held[2]
        if held is not None:
            held[1].close()
        stack = contextlib.ExitStack()
        url = stack.enter_context(
            running_router(self.gpu_url, self.cpu_url, mode=knobs.mode, extra_args=flags)
        )
        self._routers[mode] = (flags, stack, url)
        return url


async def _client(pool: ConnectionPool, url: str) -> StreamClient:
    async with make_session() as session:
        model = await discover_model(session, url)
    return StreamClient(pool, url, model)


def _scaled(records: Sequence[RequestRecord], speed: float) -> list[RequestRecord]:
    return [r.scaled(speed) for r in records]


def late_p99_ms(records: Sequence[RequestRecord], speed: float) -> float | None:
    """The p99 of the records' send lateness in simulated ms (None: none was due)."""
    late = sorted(x for r in records if (x := r.send_lateness) is not None)
    if not late:
        return None
    return 1000.0 * speed * late[min(len(late) - 1, math.ceil(0.99 * len(late)) - 1)]


async def live_single(
    url: str, scenario: MatrixScenario, rate: float, *, requests: int, seed: int, speed: float
) -> Point:
    """One open-loop run at ``rate`` (simulated req/s): the same prompts and arrivals for
    every mode (arrivals seeded as the virtual model's)."""
    specs = build_requests(requests, scenario.input_tokens, scenario.output_tokens, seed)
    warmup = build_requests(
        1, scenario.input_tokens, scenario.output_tokens, seed + 1, WARMUP_INDEX
    )
    pool = ConnectionPool()
    try:
        client = await _client(pool, url)
        result = await run_load(
            client, specs, LoadSpec(None, rate * speed, 1.0, seed), warmup=warmup
        )
    finally:
        pool.close()
    slo = SLO(scenario.slo_ttft_ms, scenario.slo_tpot_ms)
    scaled = _scaled(result.records, speed)
    good = sum(1 for r in scaled if slo.met_by(r))
    attainment = 100.0 * good / len(specs)
    routes, misses = tally(scaled, (_label(r.decision, r.reason) for r in scaled), slo)
    return Point(
        len(specs), good, attainment, rate * attainment / 100.0,
        late_p99_ms=late_p99_ms(result.records, speed), routes=routes, misses=misses,
    )  # fmt: skip


def _tiered(specs: list[RequestSpec], tier: str) -> list[RequestSpec]:
    return [replace(s, service_tier=tier) for s in specs]


async def live_mixed(
    url: str,
    scenario: MatrixScenario,
    knobs: PolicyKnobs,
    batch_rate: float,
    *,
    requests: int,
    seed: int,
    speed: float,
) -> Point:
    """Batch requests from time 0, interactive ones after the warm-up, as ``hetero.mixed``
    offers them (the same arrival seeds); batch tokens counted within the window."""
    assert scenario.traffic is not None
    traffic = MIXED_SCENARIOS[scenario.traffic]
    load = mixed_load(scenario, batch_rate, requests)
    inter, batch = traffic.for_class("interactive"), traffic.for_class("batch")
    n_inter = max(1, round(load.interactive_rate * load.window_s))
    n_batch = round(load.batch_rate * load.span_s)
    inter_specs = _tiered(
        build_requests(n_inter, inter.input_tokens, inter.output_tokens, seed),
        SERVICE_TIERS["interactive"],
    )
    batch_specs = _tiered(
        build_requests(
            n_batch, batch.input_tokens, batch.output_tokens, seed + BATCH_SEED_OFFSET,
            BATCH_INDEX,
        ),
        SERVICE_TIERS["batch"],
    )  # fmt: skip
    pool = ConnectionPool()
    try:
        client = await _client(pool, url)

        async def interactive() -> list[RequestRecord]:
            await asyncio.sleep(load.warmup_s / speed)
            spec = LoadSpec(None, load.interactive_rate * speed, 1.0, seed)
            return (await run_load(client, inter_specs, spec)).records

        async def batch_run() -> tuple[list[RequestRecord], float]:
            if not batch_specs:
                return [], 0.0
            spec = LoadSpec(None, load.batch_rate * speed, 1.0, seed + BATCH_SEED_OFFSET)
            result = await run_load(client, batch_specs, spec)
            return result.records, result.started_at - result.wall_offset

        inter_records, (batch_records, batch_start) = await asyncio.gather(
            interactive(), batch_run()
        )
    finally:
        pool.close()
    i_slo, b_slo = class_slo(knobs, "interactive"), class_slo(knobs, "batch")
    inter_scaled = _scaled(inter_records, speed)
    good = sum(1 for r in inter_scaled if i_slo.met_by(r))
    routes, misses = tally(
        inter_scaled, (_label(r.decision, r.reason) for r in inter_scaled), i_slo
    )
    # The window in the generator's clock (perf_counter, unscaled): from the batch stream's
    # start, the warm-up and then the window, in wall seconds.
    low = batch_start + load.warmup_s / speed
    high = batch_start + load.span_s / speed
    tokens = 0
    for record, scaled in zip(batch_records, _scaled(batch_records, speed), strict=True):
        if b_slo.met_by(scaled):
            tokens += sum(1 for at in record.chunk_times if low <= at < high)
    attainment = 100.0 * good / n_inter
    late = late_p99_ms([*inter_records, *batch_records], speed)
    return Point(
        n_inter, good, attainment, good / load.window_s, tokens / load.window_s,
        late_p99_ms=late, routes=routes, misses=misses,
    )  # fmt: skip


# A live cell whose host was busier than this measured the harness as much as the system:
# engines, router and load generator share this machine's cores.
HOST_BOUND = 90.0


def busy_since_last_call() -> float:
    """% of the host's CPU busy (not idle, not waiting on I/O) since the previous call."""
    return float(psutil.cpu_percent(interval=None))


def live_point(
    live: LivePair,
    scenario: MatrixScenario,
    mode: str,
    rate: float,
    *,
    requests: int,
    seed: int,
    mixed_requests: int = MIXED_REQUESTS,
) -> Point:
    knobs = knobs_for(scenario, mode)
    url = live.router(mode, knobs)
    busy_since_last_call()  # starts the interval
    if scenario.mixed:
        point = asyncio.run(
            live_mixed(
                url, scenario, knobs, rate, requests=mixed_requests, seed=seed, speed=live.speed
            )
        )
    else:
        point = asyncio.run(
            live_single(url, scenario, rate, requests=requests, seed=seed, speed=live.speed)
        )
    return replace(point, host_busy=busy_since_last_call())


@dataclass
class MatrixRun:
    """How to run the matrix."""

    requests: int = 60  # per single-class cell, at least (``steady``) or exactly
    steady: bool = True  # each cell runs to its steady state (``steady_requests``)
    mixed_requests: int = MIXED_REQUESTS
    seed: int = 0
    speed: float = 5.0
    live: bool = True
    connector: ConnectorConfig | None = None
    on_cell: Callable[[Cell], None] | None = None
    cells: list[Cell] = field(default_factory=list)


def groups(
    scenarios: Sequence[MatrixScenario],
) -> list[tuple[str, str, list[MatrixScenario]]]:
    """The scenarios by (pair, engines' scheduling policy), in order of first appearance:
    each group runs on one set of engines."""
    out: dict[tuple[str, str], list[MatrixScenario]] = {}
    for s in scenarios:
        out.setdefault((s.pair, "priority" if s.mixed else "fcfs"), []).append(s)
    return [(pair, policy, items) for (pair, policy), items in out.items()]


@contextlib.contextmanager
def _engines(run: MatrixRun, pair: Pair, policy: str) -> Iterator[LivePair | None]:
    if not run.live:
        yield None
        return
    if run.connector is None:
        raise ValueError("a live run needs the KV connector's config (testbed.vllm_env)")
    with LivePair(pair, speed=run.speed, connector=run.connector, scheduling=policy) as live:
        yield live


def run_matrix(scenarios: Sequence[MatrixScenario], run: MatrixRun) -> list[Cell]:
    """Every scenario at each of its rates: live (unless ``run.live`` is off), then virtual."""
    for _, policy, items in groups(scenarios):
        with _engines(run, scenario_pair(items[0]), policy) as live:
            for scenario in items:
                for rate in scenario.rates:
                    requests = run.requests
                    if run.steady and not scenario.mixed:
                        requests = scenario.requests_at(rate, run.requests)
                    points = None
                    if live is not None:
                        points = {
                            m: live_point(
                                live,
                                scenario,
                                m,
                                rate,
                                requests=requests,
                                seed=run.seed,
                                mixed_requests=run.mixed_requests,
                            )
                            for m in MODES
                        }
                    virtual = {
                        m: virtual_point(
                            scenario,
                            m,
                            rate,
                            requests=requests,
                            seed=run.seed,
                            mixed_requests=run.mixed_requests,
                        )
                        for m in MODES
                    }
                    cell = Cell(scenario, rate, virtual, points)
                    run.cells.append(cell)
                    if run.on_cell is not None:
                        run.on_cell(cell)
    return run.cells


# -- the report ------------------------------------------------------------------------------


def _pct(point: Point | None) -> str:
    return "-" if point is None else f"{point.attainment:.0f}%"


def _x(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def _err(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{100 * value:.0f}%"


def _single(point: Point | None) -> str:
    return "-" if point is None else f"{point.goodput:.3g} ({point.attainment:.0f}%)"


def _mixed(point: Point | None) -> str:
    if point is None:
        return "-"
    return f"{point.batch_tokens_per_s or 0:.0f} tok/s ({point.attainment:.0f}%)"


TABLE_HEAD = (
    "| scenario | pair | shape | tokens | SLO TTFT/TPOT (ms) | rate | live GPU-only "
    "| live hetero | live ratio | virtual GPU-only | virtual hetero | virtual ratio "
    "| virtual error | host CPU | send late p99 (ms) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(cell: Cell) -> str:
    s = cell.scenario
    show = _mixed if s.mixed else _single
    live = cell.live or {}
    if s.mixed:
        tokens = f"{s.traffic} (interactive {s.interactive_rate:g} req/s)"
        rate = f"batch {cell.rate:g}"
    else:
        heavy = " *" if s.decode_heavy else ""
        tokens = f"{s.input_tokens} -> {s.output_tokens}{heavy}"
        rate = f"{cell.rate:g}"
    return (
        f"| {s.id} | {s.pair} | {s.shape} | {tokens} | {s.slo_ttft_ms:g} / {s.slo_tpot_ms:g} "
        f"| {rate} | {show(live.get('gpu'))} | {show(live.get('hetero'))} "
        f"| {_x(cell.ratio('live'))} | {show(cell.virtual['gpu'])} "
        f"| {show(cell.virtual['hetero'])} | {_x(cell.ratio('virtual'))} | {_err(cell.error())} "
        f"| {_host(cell)} | {_late(cell)} |"
    )


def _host(cell: Cell) -> str:
    """The host's busy % during the live runs (GPU-only / hetero), ``!`` past ``HOST_BOUND``."""
    if cell.live is None:
        return "-"
    shown = []
    for m in MODES:
        busy = cell.live[m].host_busy
        shown.append("?" if busy is None else f"{busy:.0f}%" + ("!" if busy > HOST_BOUND else ""))
    return " / ".join(shown)


def _late(cell: Cell) -> str:
    """The generator's send lateness p99 (GPU-only / hetero), simulated ms."""
    if cell.live is None:
        return "-"
    late = [cell.live[m].late_p99_ms for m in MODES]
    return " / ".join("?" if x is None else f"{x:.0f}" for x in late)


def format_table(cells: Sequence[Cell]) -> str:
    return "\n".join([TABLE_HEAD, *(table_row(c) for c in cells)])


@dataclass(frozen=True)
class Target:
    name: str
    met: bool | None  # None: nothing to judge
    worst: str

    def line(self) -> str:
        verdict = {True: "met", False: "NOT met", None: "not judged"}[self.met]
        return f"- {self.name}: {verdict}; {self.worst}"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _best_mixed(cells: Sequence[Cell], mode: str, which: str) -> tuple[float, Point | None]:
    """The highest batch rate at which interactive traffic met 99 %, every lower rate
    meeting it too (``BatchSearch.best``), and its point."""
    best: tuple[float, Point | None] = (0.0, None)
    for cell in sorted(cells, key=lambda c: c.rate):
        side = cell.side(which)
        if side is None:
            return best
        if side[mode].attainment < INTERACTIVE_ATTAINMENT:
            break
        best = (cell.rate, side[mode])
    return best


def at_slo(cells: Sequence[Cell], mode: str, which: str) -> float:
    """``mode``'s goodput at SLO on one scenario's cells: its good requests/s at the highest
    rate it serves at ``KNEE_ATTAINMENT`` % or more (0 where it serves none), the quantity
    the matrix's knees are found by."""
    points = [side[mode] for c in cells if (side := c.side(which)) is not None]
    return max((p.goodput for p in points if p.attainment >= KNEE_ATTAINMENT), default=0.0)


def targets(cells: Sequence[Cell], which: str = "live") -> list[Target]:
    """The issue's targets on ``which`` side's results (``live``, or ``virtual`` for a
    virtual-only run), each with its worst case."""
    single = [c for c in cells if not c.scenario.mixed and c.side(which) is not None]
    out: list[Target] = []
    scenarios = {c.scenario.id: c.scenario for c in single}
    pairs = {s.pair for s in scenarios.values()}
    past = all(c.scenario.rates[-1] > c.scenario.knee for c in single)
    out.append(
        Target(
            "coverage: >= 12 single-class scenarios over both pairs, 3 rates each, the last "
            "past the GPU's knee",
            len(scenarios) >= 12 and len(pairs) >= 2 and past,
            f"{len(scenarios)} scenarios over {len(pairs)} pair(s), {len(single)} cells",
        )
    )
    if single:
        worst = min(single, key=lambda c: c.ratio(which) or 0.0)
        value = worst.ratio(which) or 0.0
        out.append(
            Target(
                f"no harm: hetero >= {NO_HARM:g}x GPU-only goodput at every rate",
                value >= NO_HARM,
                f"worst {_x(value)} at {worst.scenario.id} rate {worst.rate:g}",
            )
        )
    else:
        out.append(Target(f"no harm: hetero >= {NO_HARM:g}x GPU-only", None, "no cells"))
    heavy: dict[str, list[Cell]] = {}
    for c in single:
        if c.scenario.decode_heavy:
            heavy.setdefault(c.scenario.id, []).append(c)
    gains = {sid: ratio(at_slo(items, "hetero", which), at_slo(items, "gpu", which))
             for sid, items in heavy.items()}  # fmt: skip
    if gains:
        sid = min(gains, key=lambda k: gains[k])
        out.append(
            Target(
                f"decode-heavy: hetero's goodput at SLO >= {DECODE_HEAVY_GAIN:g}x GPU-only's, "
                "every scenario",
                gains[sid] >= DECODE_HEAVY_GAIN,
                f"worst {_x(gains[sid])} at {sid}",
            )
        )
    else:
        out.append(Target("decode-heavy gain", None, "no decode-heavy scenario"))
    mixed: dict[str, list[Cell]] = {}
    for c in cells:
        if c.scenario.mixed and c.side(which) is not None:
            mixed.setdefault(c.scenario.id, []).append(c)
    verdicts: dict[str, tuple[bool, str]] = {}
    for sid, items in mixed.items():
        _, gpu = _best_mixed(items, "gpu", which)
        rate, het = _best_mixed(items, "hetero", which)
        g = gpu.batch_tokens_per_s or 0.0 if gpu else 0.0
        h = het.batch_tokens_per_s or 0.0 if het else 0.0
        gain = ratio(h, g)
        verdicts[sid] = (
            het is not None and gain >= MIXED_GAIN,
            f"{sid}: hetero {h:.0f} tok/s at batch {rate:g} with interactive >= "
            f"{INTERACTIVE_ATTAINMENT:g}% vs GPU-only {g:.0f}: {_x(gain)}",
        )
    if verdicts:
        failing = [v for v in verdicts.values() if not v[0]]
        shown = failing[0][1] if failing else min(verdicts.values(), key=lambda v: v[1])[1]
        out.append(
            Target(
                f"mixed: interactive >= {INTERACTIVE_ATTAINMENT:g}% and batch tokens/s >= "
                f"{MIXED_GAIN:g}x GPU-only's, every pair",
                not failing,
                ("worst " if failing else "e.g. ") + shown,
            )
        )
    else:
        out.append(Target("mixed traffic", None, "no mixed scenario"))
    errors = [(c.error(), c) for c in single]
    judged = [(e, c) for e, c in errors if e is not None]
    if judged:
        e, c = max(judged, key=lambda x: x[0])
        out.append(
            Target(
                f"virtual vs live goodput within {100 * VIRTUAL_ERROR:g}% on the matrix",
                e <= VIRTUAL_ERROR,
                f"worst {_err(e)} at {c.scenario.id} rate {c.rate:g}",
            )
        )
    else:
        out.append(Target("virtual vs live within 10%", None, "no live results"))
    return out


def document(
    scenarios: Sequence[MatrixScenario], cells: Sequence[Cell], meta: dict[str, object]
) -> dict[str, object]:
    which = "live" if any(c.live is not None for c in cells) else "virtual"
    return {
        **meta,
        "judged_on": which,
        "scenarios": [s.to_dict() for s in scenarios],
        "cells": [c.to_dict() for c in cells],
        "targets": [t.to_dict() for t in targets(cells, which)],
    }
