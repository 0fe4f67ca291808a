"""The aiohttp application: OpenAI endpoints, proxying, health, metrics and error shaping."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.policy_schema import MODES, PolicyKnobs
from router.access import (
    MODE_HEADER,
    MODE_HEADER_BENCHMARK_KEYS,
    NOT_RELAYED,
    allowed_mode_header,
    bearer,
    forwarded_headers,
    key_matches,
    proxied_path,
)
from router.backends import SCRAPE_FAILURE_KINDS, Backend, Timeouts
from router.client_stream import ClientGone, ClientRequest
from router.deadlines import DEADLINES
from router.decide import (
    Decision,
    Route,
    cpu_allowed,
    decide,
    hold_to_limits,
    retry_after_seconds,
)
from router.errors import RouterError, error_response, saturated, unavailable
from router.flow import Exchange
from router.metrics import RouterMetrics
from router.state import Deployment, RouterState
from router.transport import BackendRemoved, UpstreamFailed, request
from router.validate import check_request, parse_body, strip_router_fields

log = logging.getLogger("syshax.router")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_body_bytes: int = 10 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Keys that get in like the API key and may force a policy mode (router/access.py).
    benchmark_keys: tuple[str, ...] = ()
    # Who may force a policy mode with X-Syshax-Mode: benchmark-keys, all or off.
    mode_header: str = MODE_HEADER_BENCHMARK_KEYS


class Router:
    """Everything a handler needs: live state, metrics and configuration."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = RouterState(config.timeouts)
        self.metrics = RouterMetrics()

    def record_rejection(self, decision: Decision) -> RouterError:
        self.metrics.count_request(Route.REJECTED.value, "rejected")
        knobs = self.state.default_policy().knobs
        retry = retry_after_seconds(knobs)
        if decision.status == 429:
            return saturated(f"all engines are saturated: {decision.reason}", retry_after=retry)
        return unavailable(
            f"no engine can serve this request: {decision.reason}", retry_after=retry
        )

    def refuse(self, reason: str, err: RouterError) -> RouterError:
        """A request turned away for asking what its client may not (a router-only field,
        a forced mode without a benchmark key, an engine path not listed): counted."""
        self.metrics.refusal(reason)
        return err


def forced_knobs(base: PolicyKnobs, header: str | None) -> PolicyKnobs | None:
    """The policy with its mode forced by the X-Syshax-Mode header, so the benchmark's CPU,
    GPU and hetero modes run through one router on the same engines. ``auto`` forces the
    heterogeneous scheduler on (PD offload enabled) whatever the live policy says."""
    if header is None:
        return None
    mode = header.strip().lower()
    if mode not in MODES:
        raise RouterError(
            400,
            f"{MODE_HEADER} must be one of {', '.join(MODES)}; got {header!r}",
            param=MODE_HEADER,
            code="invalid_mode",
        )
    return replace(
        base,
        mode=mode,
        enable_auto_pd_offload=True if mode == "auto" else base.enable_auto_pd_offload,
    )


# Other replicas of the model a request may be moved to after failing before any output.
MAX_REPLICA_FAILOVERS = 2


def _fallback(
    router: Router, deployment: Deployment, failed: Route, req: ClientRequest
) -> Decision | None:
    """The next route on the same deployment after ``failed`` could not be served, or None
    when nothing is left there."""
    # Read live: the policy may have changed while the failed route was being tried.
    knobs = router.state.knobs_for(deployment, req.knobs)
    now = time.monotonic()
    cpu_ok = deployment.cpu is not None and deployment.cpu.available(now)
    nxt = None
    if failed in (Route.GPU_ONLY, Route.PD) and cpu_ok and cpu_allowed(knobs):
        nxt = Decision(Route.CPU_ONLY, reason="GPU engine failed", fallback=True)
    elif failed is Route.CPU_ONLY and deployment.gpu.available(now) and knobs.mode != "cpu-only":
        nxt = Decision(Route.GPU_ONLY, reason="CPU engine failed", fallback=True)
    if nxt is not None and _forced(req):
        nxt = hold_to_limits(nxt, knobs, deployment.loads(now))
    return nxt if nxt is not None and nxt.route is not Route.REJECTED else None


def _forced(req: ClientRequest) -> bool:
    """Whether the request pinned its route with X-Syshax-Mode (``auto`` pins nothing: the
    decider's own limits apply)."""
    return req.knobs is not None and req.knobs.mode != "auto"


def _plan(
    router: Router, req: ClientRequest, deployment: Deployment
) -> tuple[Decision, PolicyKnobs]:
    """The route for ``req`` on ``deployment``, and the knobs it was decided with."""
    base = router.state.policy_for(deployment).knobs
    req.knobs = forced_knobs(base, req.mode_header)
    knobs = req.knobs or base
    loads = deployment.loads(time.monotonic())
    decision = decide(knobs, loads)
    if decision.route is Route.PD and (req.body.get("n") or 1) > 1:
        # Splicing several choices across engines is not worth it; the GPU serves n > 1.
        decision = Decision(Route.GPU_ONLY, reason="n > 1", code="n-above-1")
    if decision.route is Route.PD and deployment.cpu is None:
        decision = Decision(Route.GPU_ONLY, reason="deployment has no CPU engine", code="no-cpu")
    if decision.route is Route.PD:
        why = deployment.pd.unspliceable(req.body)
        if why is not None:
            decision = Decision(Route.GPU_ONLY, reason=why, code="not-spliceable")
    if _forced(req):
        # A forced mode picks the device, never past the policy's hard limits.
        decision = hold_to_limits(decision, knobs, loads)
    router.metrics.decision("new", decision.route.value, decision.code)
    return decision, knobs


def _other_replica(
    router: Router, req: ClientRequest, tried: set[int]
) -> tuple[Deployment, Decision] | None:
    """The least-loaded replica of the request's model not yet tried that would take it.
    A replica that would turn it away (down, saturated) is skipped; the PD pair of the one
    chosen is again that deployment's own two engines."""
    while True:
        candidate = router.state.choose(req.model, exclude=tried)
        if candidate is None:
            return None
        tried.add(candidate.spec.id)
        decision, _ = _plan(router, req, candidate)
        if decision.route is not Route.REJECTED:
            return candidate, decision


def _handed_over(exchange: Exchange, task: asyncio.Task[Any]) -> BackendRemoved | None:
    """The failure to serve elsewhere when this cancellation is the one that
    ``Exchange.backend_removed`` asked for; None when the task is (also) cancelled for
    another reason - the client left, or the request deadline passed."""
    backend = exchange.removed_from
    if backend is None:
        return None
    exchange.removed_from = None
    task.uncancel()
    if task.cancelling():
        return None
    return BackendRemoved(backend)


async def _serve(
    router: Router,
    http: web.Request,
    req: ClientRequest,
    deployment: Deployment,
    decision: Decision,
    knobs: PolicyKnobs,
) -> web.StreamResponse:
    metrics = router.metrics
    first_byte = router.config.timeouts.first_byte
    task = asyncio.current_task()
    assert task is not None
    exchange = Exchange(http, req, router.state, deployment, metrics, first_byte, task)
    tried = {deployment.spec.id}
    failovers = 0
    label = decision.route.value
    outcome = "error"
    try:
        async with DEADLINES.cancel_after(knobs.request_timeout_seconds):
            while True:
                if decision.fallback:
                    metrics.fallback(f"to-{decision.route.value}")
                label = exchange.out.decision_label = decision.route.value
                failure: UpstreamFailed
                try:
                    if decision.route is Route.PD:
                        response = await exchange.run_pd(decision)
                    else:
                        backend = (
                            deployment.gpu if decision.route is Route.GPU_ONLY else deployment.cpu
                        )
                        assert backend is not None
                        response = await exchange.passthrough(backend)
                    outcome = "ok" if response.status < 400 else "error"
                    return response
                except UpstreamFailed as exc:
                    failure = exc
                except asyncio.CancelledError:
                    removed = _handed_over(exchange, task)
                    if removed is None:
                        raise
                    failure = removed
                if failure.client_error and not exchange.out.started:
                    outcome = "client_error"
                    return web.Response(
                        status=failure.status or 400,
                        body=failure.body or b"",
                        content_type="application/json",
                    )
                exchange.record_failure(failure)
                if exchange.out.started:
                    return await exchange.out.abort(str(failure), client_gone_ok=True)
                nxt = _fallback(router, deployment, decision.route, req)
                if nxt is not None:
                    decision = nxt
                    continue
                # Nothing was sent yet: another replica of the model may serve it whole.
                replica = (
                    _other_replica(router, req, tried)
                    if failovers < MAX_REPLICA_FAILOVERS
                    else None
                )
                if replica is None:
                    raise unavailable(
                        f"{failure}; no other engine can serve this request"
                        + (f" ({failovers + 1} replicas tried)" if failovers else ""),
                        retry_after=retry_after_seconds(knobs),
                    ) from None
                failovers += 1
                deployment, decision = replica
                metrics.failover(failure.reason)
                log.info(
                    "request moves to deployment %s (%s): %s",
                    deployment.spec.name,
                    decision.route.value,
                    failure,
                )
                exchange = Exchange(http, req, router.state, deployment, metrics, first_byte, task)
    except TimeoutError:
        if exchange.out.started:
            return await exchange.out.abort("request timed out", client_gone_ok=True)
        raise RouterError(
            504,
            f"request exceeded {knobs.request_timeout_seconds:g}s",
            type_="timeout",
            code="request_timeout",
        ) from None
    except ClientGone:
        outcome = "cancelled"
        return exchange.out.response or web.Response(status=499)
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        metrics.count_request(label, outcome)


async def completions(http: web.Request) -> web.StreamResponse:
    router = http.app[ROUTER_KEY]
    received = time.perf_counter()
    chat = http.path.endswith("/chat/completions")
    config = router.config
    try:
        mode_header = allowed_mode_header(http.headers, config.mode_header, config.benchmark_keys)
    except RouterError as err:
        raise router.refuse("mode-header", err) from None
    raw = await _read_body(http, config.max_body_bytes)
    body = parse_body(raw)
    model, stream, include_usage, max_tokens = check_request(body, chat=chat)
    # Every path sends these bytes (passthrough) or this body (PD, fallbacks, failover).
    raw = _without_router_fields(router, body, raw)
    deployment = router.state.choose(model)
    if deployment is None:
        known = ", ".join(sorted(router.state.by_model)) or "none"
        raise RouterError(
            404,
            f"The model '{model}' does not exist (served models: {known})",
            param="model",
            code="model_not_found",
        )
    req = ClientRequest(
        path=http.path,
        chat=chat,
        body=body,
        raw=raw,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        received_at=received,
        mode_header=mode_header,
    )
    decision, knobs = _plan(router, req, deployment)
    if decision.route is Route.REJECTED:
        raise router.record_rejection(decision)
    return await _serve(router, http, req, deployment, decision, knobs)


def _without_router_fields(router: Router, body: dict[str, Any], raw: bytes) -> bytes:
    """``raw`` without the router-only fields the client sent empty (``body`` loses them
    too; the bytes are encoded again only then). One that carries anything is a 400."""
    try:
        changed = strip_router_fields(body)
    except RouterError as err:
        raise router.refuse("router-field", err) from None
    return json.dumps(body).encode() if changed else raw


async def _read_body(http: web.Request, limit: int) -> bytes:
    length = http.content_length
    if length is not None and length > limit:
        raise RouterError(
            413, f"request body is {length} bytes; the limit is {limit}", code="body_too_large"
        )
    try:
        return await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise RouterError(
            413, f"request body exceeds the limit of {limit} bytes", code="body_too_large"
        ) from None


async def models(http: web.Request) -> web.Response:
    router = http.app[ROUTER_KEY]
    data = [
        {
            "id": model,
            "object": "model",
            "created": int(router.metrics.started),
            "owned_by": "syshax",
            "deployments": [d.spec.name for d in deployments],
        }
        for model, deployments in sorted(router.state.by_model.items())
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


async def metrics_endpoint(http: web.Request) -> web.Response:
    router = http.app[ROUTER_KEY]
    metrics = router.metrics
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
        body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def proxy(http: web.Request) -> web.StreamResponse:
    """The engine API paths the router does not serve itself (``access.PROXIED``: /version,
    /tokenize ...) go to a GPU engine, as sysHAX does, with the client's content headers
    only; any other path is a 404."""
    router = http.app[ROUTER_KEY]
    try:
        path = proxied_path(http.method, http.path)
    except RouterError as err:
        raise router.refuse("path", err) from None
    deployments = router.state.deployments
    if not deployments:
        raise RouterError(404, f"no route for {http.path}", code="not_found")
    now = time.monotonic()
    gpu = next((d.gpu for d in deployments if d.gpu.available(now)), deployments[0].gpu)
    headers = forwarded_headers(http.headers)
    body = await _read_body(http, router.config.max_body_bytes)
    if body:
        body = _without_router_fields(router, parse_body(body), body)
    response: web.StreamResponse | None = None
    try:
        async with request(
            gpu,
            path,
            body,
            first_byte=router.config.timeouts.first_byte,
            method=http.method.encode(),
            headers=headers,
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers=[
                    (name, value)
                    for name, value in upstream.header_items()
                    if name not in NOT_RELAYED
                ],
            )
            await response.prepare(http)
            async for data in upstream.iter_body():
                await response.write(data)
            await response.write_eof()
            return response
    except UpstreamFailed as exc:
        if response is not None:
            return response  # the answer started: it ends here, cut short
        raise RouterError(
            502,
            f"GPU engine {gpu.url} did not answer: {exc}",
            type_="server_error",
            code="backend_error",
        ) from None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health", "/metrics"})


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    config = router.config
    try:
        if config.api_key is not None and request.path not in OPEN_PATHS:
            # A benchmark key gets in as the API key does.
            keys = (config.api_key, *config.benchmark_keys)
            if not key_matches(bearer(request.headers.get("Authorization", "")), keys):
                raise RouterError(
                    401,
                    "Incorrect or missing API key",
                    type_="invalid_request_error",
                    code="invalid_api_key",
                )
        return await handler(request)
    except RouterError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status == 413:
            return error_response(RouterError(413, "request body too large", code="body_too_large"))
        return error_response(
            RouterError(exc.status, exc.reason, type_="invalid_request_error", code=str(exc.status))
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        # Log the trace for the operator; the client gets the OpenAI shape and no trace.
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(
            RouterError(500, "internal router error", type_="server_error", code="internal_error")
        )


def build_app(router: Router) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware], client_max_size=router.config.max_body_bytes
    )
    app[ROUTER_KEY] = router
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app
