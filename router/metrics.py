"""The router's own Prometheus metrics, plus the small rolling figures sent as stats."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.decisions import SHED_CODES, Code, Route, Stage
from common.policy_schema import SLO_CLASSES
from common.serving import bucket_key, histogram_from_cumulative
from router.engines.load import EngineSample
from router.engines.transport import FAILURE_REASONS

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


# Queue waits run from milliseconds (a scrape tick) to a batch class's TTFT target.
_QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Why flow control turned a request away (the shed counter's label; router/flow.py).
SHED_REASONS = tuple(code.value for code in SHED_CODES)


# Why a request was refused before any engine saw it (the refusals counter's label).
REFUSAL_REASONS = ("router-field", "mode-header", "path", "tenant-header")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "syshax_router_requests",
            "Requests by scheduling decision and outcome",
            ["decision", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "syshax_router_time_to_first_token_seconds",
            "Router-measured time to first token",
            ["decision"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "syshax_router_inter_token_latency_seconds",
            "Router-measured inter-token latency",
            ["decision"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_errors = Counter(
            "syshax_router_backend_errors",
            "Failed upstream requests",
            ["backend", "role"],
            registry=r,
        )
        self.ejections = Counter(
            "syshax_router_backend_ejections",
            "Outlier ejections",
            ["backend", "role"],
            registry=r,
        )
        self.fallbacks = Counter(
            "syshax_router_fallbacks",
            "Requests served by a fallback path",
            ["kind"],
            registry=r,
        )
        self.failovers = Counter(
            "syshax_router_failovers",
            "Requests moved to another replica of their model before any output, by why "
            "the engine before could not serve them (connect, http, timeout, broken, removed)",
            ["reason"],
            registry=r,
        )
        for reason in FAILURE_REASONS:
            self.failovers.labels(reason)  # exported at 0 from the start, for rate()
        self.decision_reasons = Counter(
            "syshax_router_decisions",
            "Scheduling decisions by stage (new: a request arrives; chunk: a CPU decode chunk "
            "ended), route and reason (the decider's code, docs/router.md)",
            ["stage", "route", "reason"],
            registry=r,
        )
        self.replica_choices = Counter(
            "syshax_router_replica_choices",
            "Replicas chosen for a request among several, by the picker's code (prefix-hit, "
            "least-loaded; docs/router.md, 'Prefix-aware replica choice')",
            ["reason"],
            registry=r,
        )
        for code in (Code.PREFIX_HIT, Code.LEAST_LOADED):
            self.replica_choices.labels(code)  # exported at 0 from the start, for rate()
        self.refusals = Counter(
            "syshax_router_refusals",
            "Requests turned away for asking what a client may not: router-field (a field "
            "only the router sets, e.g. kv_transfer_params), mode-header (X-Syshax-Mode "
            "without a benchmark key), path (an engine path the router does not forward)",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)  # exported at 0 from the start, for rate()
        self.chunks = Counter(
            "syshax_router_decode_chunks",
            "Decode segments by device",
            ["device"],
            registry=r,
        )
        # The decode engine's own evidence that it used the handed-over KV (docs/router.md).
        self.kv_transfers = Counter(
            "syshax_router_kv_transfers",
            "PD KV handoffs by outcome: hit (the decode engine reports the transferred "
            "tokens as cached), kv_miss (it recomputed them), unverified (no usage report "
            "came back), none (the prefill engine published no transfer), fallback (the "
            "prefill engine could not publish it, its arena full, and decoded it itself)",
            ["outcome"],
            registry=r,
        )
        self.policy_version = Gauge(
            "syshax_router_policy_version",
            "Version of the applied policy",
            ["policy"],
            registry=r,
        )
        self.policy_age = Gauge(
            "syshax_router_policy_age_seconds",
            "Seconds since the applied policy was loaded",
            ["policy"],
            registry=r,
        )
        self.invalid_policies = Counter(
            "syshax_router_policy_rejections",
            "Policies rejected as invalid",
            registry=r,
        )
        self.invalid_deployments = Counter(
            "syshax_router_deployment_rejections",
            "Deployments files rejected as invalid (standalone --deployments-file)",
            registry=r,
        )
        self.backend_up = Gauge(
            "syshax_router_backend_up",
            "1 if the backend is up and not ejected",
            ["backend", "role"],
            registry=r,
        )
        # What the router last scraped from each engine, set at exposition time; a value
        # the router does not know (never scraped, engine down, not exported) has no sample.
        self.backend_running = Gauge(
            "syshax_router_backend_running",
            "Sequences running on the engine, as last scraped",
            ["backend", "role"],
            registry=r,
        )
        self.backend_waiting = Gauge(
            "syshax_router_backend_waiting",
            "Requests waiting in the engine, as last scraped",
            ["backend", "role"],
            registry=r,
        )
        self.backend_kv_usage = Gauge(
            "syshax_router_backend_kv_usage_perc",
            "Engine KV cache usage in percent (0-100), as last scraped",
            ["backend", "role"],
            registry=r,
        )
        self.backend_throughput = Gauge(
            "syshax_router_backend_throughput_tokens_per_second",
            "Engine generation throughput between its last two scrapes",
            ["backend", "role"],
            registry=r,
        )
        self.backend_itl = Gauge(
            "syshax_router_backend_itl_seconds",
            "Engine mean inter-token latency between its last scrapes that saw tokens",
            ["backend", "role"],
            registry=r,
        )
        self.backend_scrape_age = Gauge(
            "syshax_router_backend_scrape_age_seconds",
            "Seconds since the engine's last successful metrics scrape",
            ["backend", "role"],
            registry=r,
        )
        self.backend_scrape_duration = Gauge(
            "syshax_router_backend_scrape_duration_seconds",
            "How long the engine's last successful metrics scrape took",
            ["backend", "role"],
            registry=r,
        )
        self.backend_stale = Gauge(
            "syshax_router_backend_stale",
            "1 if the engine's latest scrape timed out or was unreadable (still routed to)",
            ["backend", "role"],
            registry=r,
        )
        self.scrape_failures = Counter(
            "syshax_router_scrape_failures",
            "Failed engine metrics scrapes by kind (timeout, connect, http, parse)",
            ["backend", "role", "kind"],
            registry=r,
        )
        # Per tenant (names come from the control plane's bounded list; router/client/tenants.py).
        self.tenant_requests = Counter(
            "syshax_router_tenant_requests",
            "Requests that got past the key check, by tenant and outcome (ok, error, rejected)",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "syshax_router_tenant_tokens",
            "Tokens used by tenant and kind (prompt, completion)",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            "syshax_router_tenant_rejections",
            "Requests of a tenant refused, by reason (rpm, tpm, model, class, shed, queue-timeout)",
            ["tenant", "reason"],
            registry=r,
        )
        # SLO classes and flow control (docs/slo-classes.md).
        self.class_decisions = Counter(
            "syshax_router_class_decisions",
            "Decisions for new requests by SLO class, route and reason (the decider's code)",
            ["class", "route", "reason"],
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "syshax_router_queue_wait_seconds",
            "How long requests waited in the router's class queues, whatever ended the wait",
            ["class"],
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.queue_depths = Gauge(
            "syshax_router_queue_depth",
            "Requests waiting in the router's class queues, all deployments together",
            ["class"],
            registry=r,
        )
        self.sheds = Counter(
            "syshax_router_shed",
            "Requests turned away by flow control, by class and reason: queue-full (an "
            "arrival at full queues), evicted (a queued sheddable request made room for a "
            "request that may not be shed), fair-share (a queued request of the tenant "
            "holding the most of the queues made room for another tenant's), timeout (its "
            "wait passed its limit)",
            ["class", "reason"],
            registry=r,
        )
        for slo_class in SLO_CLASSES:
            self.queue_depths.labels(slo_class).set(0)
            for reason in SHED_REASONS:
                self.sheds.labels(slo_class, reason)  # exported at 0 from the start
        self.started = time.time()
        # Rolling figures for the stats report (the histograms cannot give exact quantiles).
        self.recent_ttft: deque[float] = deque(maxlen=2048)
        self.decisions: dict[str, int] = {route.value: 0 for route in Route}
        self.outcomes: dict[str, int] = {"ok": 0, "error": 0}
        self.backend_error_count = 0
        self.fallback_count = 0
        self.kv_counts: dict[str, int] = {}
        self.request_times: deque[float] = deque(maxlen=4096)
        # Since the previous stats report (its ``serving`` figures, common/serving.py):
        # decisions by model and route, decision reasons, TTFT histograms by model ('' all).
        self.reported_at = time.monotonic()
        self.interval_decisions: dict[str, dict[str, int]] = {}
        self.interval_reasons: dict[str, int] = {}
        self.interval_ttft: dict[str, dict[str, int]] = {}
        # Each engine's cumulative ITL histogram and token count at the previous report.
        self.reported_engines: dict[str, EngineSample] = {}
        # labels() costs a lock and a dict lookup; the few label sets are resolved once.
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_request(self, decision: str, outcome: str, model: str = "") -> None:
        self._child(self.requests, decision, outcome).inc()
        self.decisions[decision] = self.decisions.get(decision, 0) + 1
        for key in {"", model}:
            routes = self.interval_decisions.setdefault(key, {})
            routes[decision] = routes.get(decision, 0) + 1
        self.outcomes["ok" if outcome == "ok" else "error"] += 1
        self.request_times.append(time.monotonic())

    def observe_ttft(self, decision: str, seconds: float, model: str = "") -> None:
        self._child(self.ttft, decision).observe(seconds)
        self.recent_ttft.append(seconds)
        key = _TTFT_KEYS[bisect.bisect_left(_LATENCY_BUCKETS, seconds)]
        for name in {"", model}:
            histogram = self.interval_ttft.setdefault(name, {})
            histogram[key] = histogram.get(key, 0) + 1

    def observe_itl(self, decision: str, seconds: float) -> None:
        self._child(self.itl, decision).observe(seconds)

    def backend_error(self, url: str, role: str) -> None:
        self._child(self.backend_errors, url, role).inc()
        self.backend_error_count += 1

    def ejection(self, url: str, role: str) -> None:
        self._child(self.ejections, url, role).inc()

    def decision(self, stage: Stage, route: Route, reason: Code | Literal[""]) -> None:
        self._child(self.decision_reasons, stage, route, reason or "other").inc()
        if stage == Stage.NEW:
            key = f"{route}:{reason or 'other'}"
            self.interval_reasons[key] = self.interval_reasons.get(key, 0) + 1

    def replica_choice(self, code: Code) -> None:
        self._child(self.replica_choices, code).inc()

    def refusal(self, reason: str) -> None:
        self._child(self.refusals, reason).inc()

    def chunk(self, device: str) -> None:
        self._child(self.chunks, device).inc()

    def kv_transfer(self, outcome: str) -> None:
        self._child(self.kv_transfers, outcome).inc()
        self.kv_counts[outcome] = self.kv_counts.get(outcome, 0) + 1

    def failover(self, reason: str) -> None:
        self._child(self.failovers, reason).inc()

    def tenant_request(self, tenant: str, outcome: str) -> None:
        self._child(self.tenant_requests, tenant, outcome).inc()

    def tenant_token_count(self, tenant: str, kind: str, tokens: int) -> None:
        self._child(self.tenant_tokens, tenant, kind).inc(tokens)

    def tenant_rejection(self, tenant: str, reason: str) -> None:
        self._child(self.tenant_rejections, tenant, reason).inc()

    def class_decision(self, slo_class: str, route: Route, reason: Code | Literal[""]) -> None:
        self._child(self.class_decisions, slo_class, route, reason or "other").inc()

    def queue_wait(self, slo_class: str, seconds: float) -> None:
        self._child(self.queue_wait_seconds, slo_class).observe(seconds)

    def queue_depth(self, slo_class: str, depth: int) -> None:
        self._child(self.queue_depths, slo_class).set(depth)

    def shed(self, slo_class: str, reason: str) -> None:
        self._child(self.sheds, slo_class, reason).inc()

    def fallback(self, kind: str) -> None:
        self._child(self.fallbacks, kind).inc()
        self.fallback_count += 1

    def serving(self, deployments: Sequence[ServedDeployment] = ()) -> dict[str, object]:
        """What happened since the previous call (common/serving.py's shape): the decisions
        and their reasons, the TTFT and TPOT histograms, and each deployment's engines as last
        scraped. Starts the next interval."""
        now = time.monotonic()
        interval = max(0.0, now - self.reported_at)
        previous, self.reported_engines = self.reported_engines, {}
        tpot_all: dict[str, int] = {}
        seen: set[str] = set()
        entries = []
        for d in deployments:
            engines: list[dict[str, object]] = []
            tpot: dict[str, int] = {}
            for engine in (d.gpu, d.cpu):
                if engine is None:
                    continue
                figures, histogram = _engine_figures(engine, previous.get(engine.url), now)
                if engine.sample is not None:
                    self.reported_engines[engine.url] = engine.sample
                engines.append(figures)
                first = engine.url not in seen
                seen.add(engine.url)
                for key, count in histogram.items():
                    tpot[key] = tpot.get(key, 0) + count
                    if first:  # an engine two deployments name counts once in the total
                        tpot_all[key] = tpot_all.get(key, 0) + count
            model = d.spec.model
            entries.append(
                {
                    "id": d.spec.id,
                    "name": d.spec.name,
                    "model": model,
                    "decisions": dict(self.interval_decisions.get(model, {})),
                    "ttft_ms": dict(self.interval_ttft.get(model, {})),
                    "tpot_ms": tpot,
                    "engines": engines,
                }
            )
        body: dict[str, object] = {
            "interval_seconds": round(interval, 3),
            "decisions": dict(self.interval_decisions.get("", {})),
            "reasons": dict(self.interval_reasons),
            "ttft_ms": dict(self.interval_ttft.get("", {})),
            "tpot_ms": tpot_all,
            "deployments": entries,
        }
        self.reported_at = now
        self.interval_decisions, self.interval_reasons, self.interval_ttft = {}, {}, {}
        return body

    def stats(
        self, policy_version: int, deployments: Sequence[ServedDeployment] = ()
    ) -> dict[str, object]:
        ttfts = sorted(self.recent_ttft)

        def pct(q: float) -> float:
            if not ttfts:
                return 0.0
            return 1000.0 * ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]

        now = time.monotonic()
        recent = [t for t in self.request_times if now - t <= 60.0]
        return {
            "policy_version": policy_version,
            "uptime_seconds": round(time.time() - self.started, 3),
            "requests_total": sum(self.decisions.values()),
            "request_rate": round(len(recent) / 60.0, 3),
            "decisions": dict(self.decisions),
            "outcomes": dict(self.outcomes),
            "ttft_p50_ms": round(pct(0.5), 3),
            "ttft_p99_ms": round(pct(0.99), 3),
            "backend_errors": self.backend_error_count,
            "fallbacks": self.fallback_count,
            "kv_transfers": dict(self.kv_counts),
            "serving": self.serving(deployments),
        }


class SharedLimitsMetrics:
    """Whether the tenants' limits are shared through Redis or held locally for now
    (router/client/shared_limits.py), registered beside the router's own metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.local = Gauge(
            "syshax_router_limits_local",
            "1 while the shared limits' Redis is unreachable or slow and this router holds "
            "each tenant's limits locally, divided by the routers it last saw; 0 while shared",
            registry=registry,
        )
        self.fallbacks = Counter(
            "syshax_router_limits_fallbacks",
            "Times this router lost the shared limits' Redis and fell back to local limits",
            registry=registry,
        )
        self.local_admissions = Counter(
            "syshax_router_limits_local_admissions",
            "Admissions decided on this router's local buckets: Redis did not answer within "
            "the bound, or the router holds the limits locally",
            registry=registry,
        )
        self.routers = Gauge(
            "syshax_router_limits_routers",
            "Router processes registered in the shared limits' Redis at the last heartbeat",
            registry=registry,
        )
        self.local.set(0)


# The router's TTFT histogram bounds as serving keys (ms), the last one past every bound.
_TTFT_KEYS = (*(bucket_key(1000.0 * b) for b in _LATENCY_BUCKETS), "+Inf")


class ServedEngine(Protocol):
    """An engine as the stats report reads it (``router.engines.backends.Backend``)."""

    @property
    def url(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def sample(self) -> EngineSample | None: ...
    @property
    def throughput_tps(self) -> float: ...
    @property
    def itl_ms(self) -> float | None: ...
    def available(self, now: float) -> bool: ...


class ServedSpec(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...


class ServedDeployment(Protocol):
    """A deployment as the stats report reads it (``router.state.Deployment``)."""

    @property
    def spec(self) -> ServedSpec: ...
    @property
    def gpu(self) -> ServedEngine: ...
    @property
    def cpu(self) -> ServedEngine | None: ...


def _engine_figures(
    engine: ServedEngine, before: EngineSample | None, now: float
) -> tuple[dict[str, object], dict[str, int]]:
    """One engine's figures as last scraped, and its ITL histogram since ``before`` (the
    sample at the previous report; None: the engine is new to the report, no histogram).
    Tokens/s is the generated tokens between the two samples over their time apart, else
    the rate between the last two scrapes."""
    sample = engine.sample
    figures: dict[str, object] = {
        "role": engine.role,
        "url": engine.url,
        "up": engine.available(now),
        "running": None,
        "waiting": None,
        "kv_usage_perc": None,
        "tokens_per_second": None,
        "itl_ms": None,
    }
    if sample is None:
        return figures, {}
    tps: float | None = engine.throughput_tps
    if (
        before is not None
        and sample.generation_tokens is not None
        and before.generation_tokens is not None
        and sample.at > before.at
        and sample.generation_tokens >= before.generation_tokens
    ):
        tps = (sample.generation_tokens - before.generation_tokens) / (sample.at - before.at)
    itl = engine.itl_ms
    figures.update(
        running=int(sample.running),
        waiting=int(sample.waiting),
        kv_usage_perc=round(100.0 * sample.kv_usage, 3),
        tokens_per_second=round(tps, 3) if tps is not None else None,
        itl_ms=round(itl, 3) if itl is not None else None,
    )
    if before is None:  # the first report after the engine appeared sets the baseline
        return figures, {}
    return figures, histogram_from_cumulative(sample.itl_buckets, before.itl_buckets)
