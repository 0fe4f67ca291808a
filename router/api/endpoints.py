"""The router's own endpoints besides completions: the models it serves, its health and its
Prometheus metrics (docs/router.md, "Surface")."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from router.client.access import bearer, key_matches
from router.client.errors import RouterError
from router.client.tenants import ANONYMOUS, REQUEST_TENANT
from router.engines.backends import Backend
from router.engines.scrape import SCRAPE_FAILURE_KINDS
from router.state import ROUTER_KEY

# The per-tenant series (router/metrics.py): left out of /metrics without a metrics token.
TENANT_SERIES_PREFIX = "syshax_router_tenant_"


async def models(http: web.Request) -> web.Response:
    """The models of all deployments that the caller's tenant may use."""
    router = http.app[ROUTER_KEY]
    tenant = http.get(REQUEST_TENANT) or ANONYMOUS
    data = [
        {
            "id": model,
            "object": "model",
            "created": int(router.metrics.started),
            "owned_by": "syshax",
            "deployments": [d.spec.name for d in deployments],
        }
        for model, deployments in sorted(router.state.by_model.items())
        if tenant.allows_model(model)
    ]
    return web.json_response({"object": "list", "data": data})


def _backend_view(backend: Backend, now: float) -> dict[str, object]:
    scraped = backend.scrape_view(now)

    def rounded(value: float | None) -> float | None:
        return round(value, 3) if value is not None else None

    return {
        "url": backend.url,
        "role": backend.role,
        "up": backend.up,
        "ejected": now < backend.ejected_until,
        "inflight": backend.inflight,
        "scrape": {
            "running": scraped.running,
            "waiting": scraped.waiting,
            "kv_usage_perc": rounded(scraped.kv_usage_perc),
            "throughput_tps": rounded(scraped.throughput_tps),
            "itl_ms": rounded(scraped.itl_ms),
            "age_seconds": rounded(scraped.scrape_age_seconds),
            "duration_ms": rounded(scraped.scrape_duration_ms),
            "stale": scraped.stale,
            "error": scraped.last_error,
        },
    }


async def health(http: web.Request) -> web.Response:
    router = http.app[ROUTER_KEY]
    now = time.monotonic()
    backends = list(router.state.backends.values())
    serving = any(b.available(now) for b in backends)
    policy = router.state.default_policy()
    body = {
        "status": "ok" if serving else "unavailable",
        # Which process answered: with --workers several share the port.
        "pid": os.getpid(),
        "policy_version": policy.version,
        "mode": policy.knobs.mode,
        "algorithm": policy.knobs.algorithm,
        "backends": [_backend_view(b, now) for b in backends],
        # Backends that left the deployment set and still carry streams; closed after them.
        "closing": [
            {"url": b.url, "role": b.role, "inflight": b.inflight} for b in router.state.closing
        ],
    }
    return web.json_response(body, status=200 if serving else 503)


class _WithoutTenants(Collector):
    """A registry's metrics less every series that names a tenant (decision record 54)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            if family.name.startswith(TENANT_SERIES_PREFIX):
                continue
            if any("tenant" in sample.labels for sample in family.samples):
                continue
            yield family


def exposed_registry(http: web.Request, registry: CollectorRegistry) -> CollectorRegistry:
    """What ``/metrics`` shows this caller: everything to the holder of ``--metrics-token``
    (a 401 to anyone else when one is set); without a token, everything but the per-tenant
    series, so an open scrape endpoint names no tenant (decision record 54)."""
    token = http.app[ROUTER_KEY].config.metrics_token
    if token is None:
        view = CollectorRegistry(auto_describe=False)
        view.register(_WithoutTenants(registry))
        return view
    if not key_matches(bearer(http.headers.get("Authorization", "")), (token,)):
        raise RouterError(
            401,
            "/metrics needs 'Authorization: Bearer <the router's metrics token>'",
            code="invalid_api_key",
        )
    return registry


async def metrics_endpoint(http: web.Request) -> web.Response:
    router = http.app[ROUTER_KEY]
    metrics = router.metrics
    registry = exposed_registry(http, metrics.registry)
    now_wall = time.time()
    for record in router.state.policies.values():
        metrics.policy_version.labels(record.name).set(record.version)
        metrics.policy_age.labels(record.name).set(now_wall - record.applied_at)
    now = time.monotonic()
    scraped_gauges = (
        metrics.backend_running,
        metrics.backend_waiting,
        metrics.backend_kv_usage,
        metrics.backend_throughput,
        metrics.backend_itl,
        metrics.backend_scrape_age,
        metrics.backend_scrape_duration,
        metrics.backend_stale,
    )
    # Rebuilt on every exposition: an unknown value or a backend no longer configured has
    # no sample rather than a stale or made-up one.
    for gauge in scraped_gauges:
        gauge.clear()
    for backend in router.state.backends.values():
        labels = (backend.url, backend.role)
        metrics.backend_up.labels(*labels).set(1 if backend.available(now) else 0)
        view = backend.scrape_view(now)
        itl_s = view.itl_ms / 1000.0 if view.itl_ms is not None else None
        duration_s = (
            view.scrape_duration_ms / 1000.0 if view.scrape_duration_ms is not None else None
        )
        values = (
            view.running,
            view.waiting,
            view.kv_usage_perc,
            view.throughput_tps,
            itl_s,
            view.scrape_age_seconds,
            duration_s,
            1 if view.stale else 0,
        )
        for gauge, value in zip(scraped_gauges, values, strict=True):
            if value is not None:
                gauge.labels(*labels).set(value)
        failures = backend.take_scrape_failures()
        for kind in SCRAPE_FAILURE_KINDS:
            # inc(0) exports every kind from the start, so rate() has a zero to start from.
            metrics.scrape_failures.labels(*labels, kind).inc(failures.get(kind, 0))
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
