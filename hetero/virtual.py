"""A GPU engine, a CPU engine and the router's decider, run in virtual time.

The live benchmark (``syshax benchmark`` against a router in front of two simulators) is
the product's test; this is its physics without sockets or sleeping, so a whole goodput sweep
of several policies takes seconds instead of hours on a small machine. Nothing here is a
second model of the parts: the engines are the simulator's own batch schedulers
(``sim.scheduler``), and each request is routed by the router's own deciders
(``router.decide.decide`` / ``decide_next_chunk``: the decision pipeline's new-request and
chunk steps) on the loads the router would see: each
engine's metrics scraped every ``metrics_interval_seconds`` and turned into throughput and
inter-token latency by ``router.engines.load.derive_load``, plus the router's own in-flight
counts between scrapes.

What the live path does, modelled the same way here:

- gpu-only: the GPU prefills and decodes the request.
- PD: the GPU prefills and samples the first token; the KV connector saves the KV into
  shared memory, which adds its measured stall to the prefill step (``kv_export_stall``) and
  publishes it a copy's time later (``kv_export_bandwidth``); the CPU engine loads it in the
  step that admits the decode, holding that step (``kv_import_bandwidth``), and decodes
  ``token_limit`` tokens; then ``decide_next_chunk`` keeps the sequence on the CPU (its KV
  stays there) or moves it back to the GPU, which recomputes the context (no KV goes back).
- cpu-only: the CPU engine prefills and decodes.
- rejected: a 503 fails the request; a 429 (saturated) fails a request without a class, and
  sends a request with one to the router's flow control (below).

Flow control is the router's own (``router.flow.FlowControl``, driven by the virtual clock):
a request of an SLO class that the decider answers with a 429 waits in its class's queue, as
does an arrival of a class while requests of its priority or a higher one wait (no
overtaking); the queues are planned again, in priority order and first come first served
within a class, until the first request that still cannot be routed, whenever a sequence
ends on an engine and every ``router.flow.TICK_SECONDS`` while anything waits (the router
plans again when a request ends and on the same tick). A request that waits past its limit
(a sheddable class: its TTFT target; the others: ``request_timeout_seconds``) is shed and
fails, and the queues hold at most ``max_queue_size`` requests together, a sheddable one
shed to make room for an arrival that may not be. One tenant: fairness between tenants is
not modelled. A request without a class is the benchmark's (``syshax benchmark`` forces its
mode with ``X-Syshax-Mode``), which never waits in the live router either: its 429 fails it.

A request may carry an SLO class (``common.policy_schema.SLO_CLASSES``): the deciders then
judge it by that class (``knobs.slo_class``), as the router does, and an engine configured
with ``scheduling_policy="priority"`` schedules it at the class's priority, as the router's
engine request carries it to vLLM.

Not modelled: network and HTTP time, and the router's own CPU cost
(``scripts/bench/router_overhead.py`` measures those), clients that give up, and tenants.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from common.policy_schema import PolicyKnobs, SloClass
from loadgen.workload import arrival_offsets
from router.decide import Decision, Loads, Route, decide, decide_next_chunk
from router.engines.load import UNAVAILABLE, DeviceLoad, EngineSample, LoadTracker
from router.flow import TICK_SECONDS, FlowControl, Outcome, Waiter, must_wait
from sim.engine import EngineConfig, build_scheduler, plan_capacity
from sim.perfmodel import effective_hardware, kv_copy_time
from sim.scheduler import BatchScheduler, FinishReason, Sequence, Step
from sim.stats import ITL_BUCKETS, Histogram
from sim.tokens import TokenModel

INF = math.inf
# The virtual router serves one deployment, for one tenant.
DEPLOYMENT = 0
TENANT = "virtual"


@dataclass
class Request:
    index: int
    prompt_tokens: int
    output_tokens: int
    arrival: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    error: str | None = None
    route: str = ""
    reason: str = ""  # the decision's code (the router's X-Syshax-Reason)
    cpu_tokens: int = 0  # tokens the CPU engine decoded
    slo_class: str | None = None  # an SLO class name; None: judged without a class
    queued_s: float = 0.0  # how long it waited in the router's flow control
    # Tokens it received within the deployment's measuring window (``VirtualDeployment.window``).
    window_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens >= self.output_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot(self) -> float | None:
        """As ``RequestRecord.tpot``: 0 for a one-token answer, as vLLM does."""
        if self.first_token_at is None or self.last_token_at is None:
            return None
        if self.tokens < 2:
            return 0.0
        return (self.last_token_at - self.first_token_at) / (self.tokens - 1)

    @property
    def latency(self) -> float | None:
        return None if self.last_token_at is None else self.last_token_at - self.arrival


@dataclass
class Leg:
    """One request's stay on one engine; a sequence carries its leg as its ``sink``."""

    request: Request
    kind: str  # "whole", "prefill" (PD: first token on the GPU) or "decode" (a CPU chunk)
    chunk: int = 0  # a prefill's: the decode's token_limit on the CPU (0: to the end)


class VirtualEngine(LoadTracker):
    """A batch scheduler with the metrics a router scrapes from it, and what a router keeps
    of those scrapes (``LoadTracker``)."""

    def __init__(self, config: EngineConfig, role: str) -> None:
        LoadTracker.__init__(self, role)
        self.config = config
        self.capacity = plan_capacity(config)
        hw = effective_hardware(config.device, config.tensor_parallel_size)
        self.sched: BatchScheduler = build_scheduler(
            config, self.capacity, hw, TokenModel(config.seed)
        )
        self.step: Step | None = None
        self.step_end = INF
        self.wake_at = INF
        # The Prometheus counters a real engine exports.
        self.generation_tokens = 0
        self.itl_histogram = Histogram(ITL_BUCKETS)  # its sum and count are the counters
        # Prompt tokens this engine computed (not handed over), and its first tokens' times
        # since each sequence reached it: the router's CPU prefill estimate reads them.
        self.computed_prompt_tokens = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.inflight = 0
        self.busy_s = 0.0

    def next_event(self) -> float:
        return min(self.step_end, self.wake_at)

    def start_step(self, now: float) -> None:
        if self.step is not None or not self.sched.has_work():
            return
        step = self.sched.plan(now)
        if step is None:
            ready = self.sched.next_ready_at()
            self.wake_at = ready if ready is not None and ready > now else INF
            return
        self.wake_at = INF
        self.step = step
        self.step_end = now + step.duration
        self.busy_s += step.duration

    def scrape(self, now: float) -> None:
        sched = self.sched
        sample = EngineSample(
            at=now,
            running=float(len(sched.running)),
            waiting=float(len(sched.waiting) + len(sched.swapped)),
            kv_usage=sched.kv_usage(),
            generation_tokens=float(self.generation_tokens),
            itl_sum=self.itl_histogram.sum,
            itl_count=float(self.itl_histogram.count),
            avg_generation_tps=None,
            itl_buckets=self.itl_histogram.bounded_cumulative(),
            computed_prompt_tokens=float(self.computed_prompt_tokens),
            ttft_sum=self.ttft_sum,
            ttft_count=float(self.ttft_count),
        )
        self.observe(sample)

    def load(self) -> DeviceLoad:
        return self.tracked_load(self.inflight)


@dataclass
class RunStats:
    requests: list[Request]
    duration_s: float
    decisions: Counter[str] = field(default_factory=Counter)
    preemptions: dict[str, int] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)


class VirtualDeployment:
    """A GPU engine and (optionally) a CPU engine behind one router policy."""

    def __init__(
        self,
        gpu: EngineConfig | None,
        cpu: EngineConfig | None,
        knobs: PolicyKnobs,
        *,
        window: tuple[float, float] | None = None,
    ) -> None:
        if gpu is None and cpu is None:
            raise ValueError("a deployment needs at least one engine")
        self.knobs = knobs
        # Each request counts the tokens it receives from ``window[0]`` to before ``window[1]``.
        self.window = window
        self.now = 0.0
        self.flow = FlowControl(clock=lambda: self.now)
        self.next_tick = INF
        self.gpu = VirtualEngine(gpu, "gpu") if gpu is not None else None
        self.cpu = VirtualEngine(cpu, "cpu") if cpu is not None else None
        self.decisions: Counter[str] = Counter()
        self._serial = 0

    # -- routing --------------------------------------------------------------------------

    def _loads(self) -> Loads:
        gpu = self.gpu.load() if self.gpu is not None else UNAVAILABLE
        cpu = self.cpu.load() if self.cpu is not None else UNAVAILABLE
        return Loads(
            gpu=gpu,
            cpu=cpu,
            gpu_itl_slope_ms=self.gpu.itl_slope_ms if self.gpu else None,
            cpu_itl_slope_ms=self.cpu.itl_slope_ms if self.cpu else None,
            cpu_max_num_seqs=self.cpu.config.max_num_seqs if self.cpu else None,
        )

    def _count(self, decision: Decision, slo: SloClass | None = None) -> None:
        self.decisions[decision.route.value] += 1
        if decision.code:
            self.decisions[f"{decision.route.value}:{decision.code}"] += 1
        if slo is not None:
            self.decisions[f"{slo.name}:{decision.route.value}:{decision.code}"] += 1

    def _slo(self, req: Request) -> SloClass | None:
        return self.knobs.slo_class(req.slo_class) if req.slo_class else None

    def _priority(self, engine: VirtualEngine, req: Request) -> int:
        """The engine request's ``priority``: the class's, where the engine schedules by
        priority (elsewhere vLLM refuses a non-zero one)."""
        slo = self._slo(req)
        if slo is None or engine.config.scheduling_policy != "priority":
            return 0
        return slo.priority

    def _submit(
        self,
        engine: VirtualEngine,
        leg: Leg,
        now: float,
        *,
        limit: int | None = None,
        imported: int = 0,
        ready_at: float = 0.0,
        load_seconds: float = 0.0,
        export_stall_seconds: float = 0.0,
        reserved: bool = False,
    ) -> None:
        """Queue ``leg`` on ``engine``; counted in the router's in-flight count there unless
        the router already counted it when it chose the engine (``reserved``)."""
        req = leg.request
        self._serial += 1
        seq = Sequence(
            request_id=str(self._serial),
            prompt_tokens=req.prompt_tokens,
            resumed_tokens=req.tokens,
            max_new_tokens=req.output_tokens - req.tokens,
            tail=[req.index, req.tokens],
            new_token_limit=limit,
            imported_tokens=imported,
            ready_at=ready_at,
            load_seconds=load_seconds,
            export_stall_seconds=export_stall_seconds,
            arrival=now,
            priority=self._priority(engine, req),
            sink=leg,
        )
        engine.sched.add(seq)
        if not reserved:
            engine.inflight += 1

    def arrive(self, req: Request, now: float) -> None:
        """Route a new request, or queue it as the router's flow control does
        (``router.plan.route``)."""
        slo = self._slo(req)
        decision = decide(self.knobs, self._loads(), slo, prompt_tokens=req.prompt_tokens)
        if slo is None or self.knobs.max_queue_size <= 0:
            self._route(req, decision, slo, now)
            return
        flow = self.flow
        queued_ahead = flow.ahead(DEPLOYMENT, slo)
        if not (must_wait(decision) or queued_ahead):
            flow.served(DEPLOYMENT, slo.name, TENANT)
            self._route(req, decision, slo, now)
            return
        if decision.route is Route.REJECTED and not must_wait(decision):
            self._route(req, decision, slo, now)  # no engine can serve it: a 503
            return
        knobs = self.knobs
        waiter = flow.enqueue(
            DEPLOYMENT,
            slo,
            TENANT,
            lambda: decide(self.knobs, self._loads(), slo, prompt_tokens=req.prompt_tokens),
            bound=knobs.max_queue_size,
            max_wait=max_wait_seconds(slo, knobs),
        )
        self.decisions[f"{slo.name}:queued"] += 1
        if not waiter.waiting:  # shed at once: the queues were full
            self._left(req, waiter, slo)
            return
        waiter.wake = lambda: self._left(req, waiter, slo)
        if self.next_tick == INF:
            self.next_tick = now + TICK_SECONDS
        if queued_ahead:
            flow.pump(DEPLOYMENT)

    def _left(self, req: Request, waiter: Waiter, slo: SloClass) -> None:
        """``req`` left the queues: routed on the decision it was planned with, or shed."""
        req.queued_s = self.now - waiter.arrived
        if waiter.outcome is Outcome.ROUTED:
            assert waiter.decision is not None
            self._route(req, waiter.decision, slo, self.now)
            return
        reason = waiter.reason or (waiter.outcome.value if waiter.outcome else "")
        shed = Decision(Route.REJECTED, reason=reason, status=429, code=waiter.reason)
        self._route(req, shed, slo, self.now)

    def _route(self, req: Request, decision: Decision, slo: SloClass | None, now: float) -> None:
        """Act on ``req``'s final decision (counted here, as the router counts it)."""
        self._count(decision, slo)
        req.route, req.reason = decision.route.value, decision.code
        if decision.route is Route.GPU_ONLY and self.gpu is not None:
            self._submit(self.gpu, Leg(req, "whole"), now)
        elif decision.route is Route.CPU_ONLY and self.cpu is not None:
            self._submit(self.cpu, Leg(req, "whole"), now)
        elif decision.route is Route.PD and self.gpu is not None and self.cpu is not None:
            # The router counts the CPU decode from the moment it chose it.
            self.cpu.inflight += 1
            device = self.gpu.config.device
            save = kv_copy_time(
                self.gpu.config.model, req.prompt_tokens, device.kv_export_bandwidth
            )
            self._submit(
                self.gpu,
                Leg(req, "prefill", decision.token_limit),
                now,
                limit=1,
                export_stall_seconds=device.kv_export_stall * save,
            )
        else:
            req.error = f"{decision.status or 503}: {decision.reason}"

    def _tick(self, now: float) -> None:
        """The router's tick while requests wait: waits that ran out are shed, then the
        queues are planned again."""
        self.flow.tick()
        self.next_tick = now + TICK_SECONDS if self.flow.queued else INF

    def _to_cpu(
        self, req: Request, now: float, export_bw: float | None, chunk: int, *, reserved: bool
    ) -> None:
        """The decode of ``req`` on the CPU: after a handoff from the GPU (``export_bw``) its
        KV is copied through shared memory; a chunk that stays on the CPU keeps its KV (the
        same stream goes on, ``router/pd/vllm.py``)."""
        assert self.cpu is not None
        context = req.prompt_tokens + req.tokens
        model = self.cpu.config.model
        published = load = 0.0
        if export_bw is not None:
            published = kv_copy_time(model, context, export_bw)
            load = kv_copy_time(model, context, self.cpu.config.device.kv_import_bandwidth)
        self._submit(
            self.cpu,
            Leg(req, "decode"),
            now,
            limit=chunk or None,
            imported=context,
            ready_at=now + published,
            load_seconds=load,
            reserved=reserved,
        )

    def _finished(self, engine: VirtualEngine, seq: Sequence, now: float) -> None:
        leg: Leg = seq.sink
        engine.inflight -= 1
        req = leg.request
        if req.tokens >= req.output_tokens or seq.finish_reason is not FinishReason.SCHEDULED:
            if leg.kind == "prefill" and self.cpu is not None:
                self.cpu.inflight -= 1  # the decode it was counted for never happens
            return
        if leg.kind == "prefill":
            assert self.gpu is not None
            bandwidth = self.gpu.config.device.kv_export_bandwidth
            self._to_cpu(req, now, bandwidth, leg.chunk, reserved=True)
            return
        # A CPU chunk ended: decide where the rest goes.
        assert self.cpu is not None
        slo = self._slo(req)
        nxt = decide_next_chunk(self.knobs, self._loads(), slo)
        self.decisions[f"next:{nxt.route.value}:{nxt.code}"] += 1
        if slo is not None:
            self.decisions[f"{slo.name}:next:{nxt.route.value}:{nxt.code}"] += 1
        if nxt.route is Route.PD:
            self._to_cpu(req, now, None, nxt.token_limit, reserved=False)
        else:
            assert self.gpu is not None
            self._submit(self.gpu, Leg(req, "whole"), now)

    # -- the event loop -------------------------------------------------------------------

    def run(
        self,
        *,
        rate: float,
        requests: int,
        prompt_tokens: int,
        output_tokens: int,
        burstiness: float = 1.0,
        seed: int = 0,
    ) -> RunStats:
        offsets = arrival_offsets(requests, rate, burstiness, seed)
        reqs = [Request(i, prompt_tokens, output_tokens, at) for i, at in enumerate(offsets)]
        return self.run_requests(reqs)

    def run_requests(self, reqs: list[Request]) -> RunStats:
        """Serve ``reqs`` (in arrival order, each of its own shape and class) to the end."""
        if any(b.arrival < a.arrival for a, b in itertools.pairwise(reqs)):
            raise ValueError("requests must be in arrival order")
        engines = [e for e in (self.gpu, self.cpu) if e is not None]
        interval = self.knobs.metrics_interval_seconds
        next_scrape = 0.0
        i = 0
        now = 0.0
        for engine in engines:
            engine.scrape(now)
        while True:
            busy = any(e.sched.has_work() or e.step is not None for e in engines)
            busy = busy or self.flow.queued > 0
            next_arrival = reqs[i].arrival if i < len(reqs) else INF
            if not busy and next_arrival == INF:
                break
            now = min(next_arrival, next_scrape, self.next_tick, *(e.next_event() for e in engines))
            self.now = now
            for engine in engines:
                if engine.step is not None and engine.step_end <= now:
                    self._complete(engine, now)
                if engine.wake_at <= now:
                    engine.wake_at = INF
            if next_scrape <= now:
                for engine in engines:
                    engine.scrape(now)
                next_scrape = now + interval
            if self.next_tick <= now:
                self._tick(now)
            while i < len(reqs) and reqs[i].arrival <= now:
                self.arrive(reqs[i], now)
                i += 1
            for engine in engines:
                engine.start_step(now)
        start = reqs[0].arrival if reqs else 0.0
        end = max((r.last_token_at or r.arrival for r in reqs), default=0.0)
        return RunStats(
            requests=reqs,
            duration_s=max(end - start, 1e-9),
            decisions=self.decisions,
            preemptions={e.role: e.sched.preemptions_total for e in engines},
            busy={e.role: e.busy_s for e in engines},
        )

    def _complete(self, engine: VirtualEngine, now: float) -> None:
        step = engine.step
        assert step is not None
        engine.step = None
        engine.step_end = INF
        result = engine.sched.complete(step, now)
        for seq, _token in result.emitted:
            req = seq.sink.request
            times = seq.token_times
            at = times[-1]
            if len(times) > 1:
                engine.itl_histogram.observe(at - times[-2])
            elif seq.sink.kind != "decode":  # its first token, after a prefill it computed
                engine.ttft_sum += at - seq.arrival
                engine.ttft_count += 1
                engine.computed_prompt_tokens += seq.prompt_tokens + seq.resumed_tokens
            req.tokens += 1
            if self.window is not None and self.window[0] <= at < self.window[1]:
                req.window_tokens += 1
            if engine.role == "cpu":
                req.cpu_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = at
            req.last_token_at = at
        engine.generation_tokens += len(result.emitted)
        for seq in result.finished:
            self._finished(engine, seq, now)
        if result.finished and self.flow.queued:
            # A sequence ended: the engines may have room for those waiting.
            self.flow.pump(DEPLOYMENT)


def max_wait_seconds(slo: SloClass, knobs: PolicyKnobs) -> float:
    """How long a request of class ``slo`` may wait in the router's queues, by the
    router's rule (``router.plan.max_wait``): a sheddable class its TTFT target, the
    others the whole request deadline."""
    return slo.ttft_ms / 1000.0 if slo.sheddable else knobs.request_timeout_seconds
