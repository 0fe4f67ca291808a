"""The router's own Prometheus metrics, plus the small rolling figures sent as stats."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


# Why a request was refused before any engine saw it (the refusals counter's label).
REFUSAL_REASONS = ("router-field", "mode-header", "path")


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
        self.started = time.time()
        # Rolling figures for the stats report (the histograms cannot give exact quantiles).
        self.recent_ttft: deque[float] = deque(maxlen=2048)
        self.decisions: dict[str, int] = {"gpu-only": 0, "pd": 0, "cpu-only": 0, "rejected": 0}
        self.outcomes: dict[str, int] = {"ok": 0, "error": 0}
        self.backend_error_count = 0
        self.fallback_count = 0
        self.kv_counts: dict[str, int] = {}
        self.request_times: deque[float] = deque(maxlen=4096)
        # labels() costs a lock and a dict lookup; the few label sets are resolved once.
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_request(self, decision: str, outcome: str) -> None:
        self._child(self.requests, decision, outcome).inc()
        self.decisions[decision] = self.decisions.get(decision, 0) + 1
        self.outcomes["ok" if outcome == "ok" else "error"] += 1
        self.request_times.append(time.monotonic())

    def observe_ttft(self, decision: str, seconds: float) -> None:
        self._child(self.ttft, decision).observe(seconds)
        self.recent_ttft.append(seconds)

    def observe_itl(self, decision: str, seconds: float) -> None:
        self._child(self.itl, decision).observe(seconds)

    def backend_error(self, url: str, role: str) -> None:
        self._child(self.backend_errors, url, role).inc()
        self.backend_error_count += 1

    def ejection(self, url: str, role: str) -> None:
        self._child(self.ejections, url, role).inc()

    def decision(self, stage: str, route: str, reason: str) -> None:
        self._child(self.decision_reasons, stage, route, reason or "other").inc()

    def refusal(self, reason: str) -> None:
        self._child(self.refusals, reason).inc()

    def chunk(self, device: str) -> None:
        self._child(self.chunks, device).inc()

    def kv_transfer(self, outcome: str) -> None:
        self._child(self.kv_transfers, outcome).inc()
        self.kv_counts[outcome] = self.kv_counts.get(outcome, 0) + 1

    def failover(self, reason: str) -> None:
        self._child(self.failovers, reason).inc()

    def fallback(self, kind: str) -> None:
        self._child(self.fallbacks, kind).inc()
        self.fallback_count += 1

    def stats(self, policy_version: int) -> dict[str, object]:
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
        }
