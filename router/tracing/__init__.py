"""A request's trace: one server span, a child span per step the router takes for it
(docs/tracing.md, "Span tree"), and the context every engine request carries.

Off by default. Off, ``Tracer.begin`` answers the shared ``NO_TRACE``, whose steps are the
shared ``NO_STEP``: no span object is made on the request path, nothing of OpenTelemetry is
imported, and an engine request's head is the transport's own. On (``start``), a request's
spans are ``router.tracing.otel``'s, and go to the collector through
``common.tracing`` (a bounded batch queue on its own thread).

Every child span is parented on the request's server span explicitly, never through the
current context, so an engine call's span is the same child wherever its coroutine runs.
What a span may carry is listed in docs/tracing.md: never a prompt, a completion, a key or a
tenant's secret; an error is its kind and, for an engine's failure, the router's own words.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import CollectorRegistry, Counter

from router.engines.transport import JSON_HEADERS

log = logging.getLogger("syshax.router")
access_log = logging.getLogger("syshax.router.access")

TRACE_ID_HEADER = "X-Syshax-Trace-Id"
SERVICE = "syshax-router"
# Span names (docs/tracing.md): the request's steps, and an engine call's is
# ``engine <role> <call>`` with a call of ``ENGINE_CALLS``.
ADMISSION = "admission"
FLOW_WAIT = "flow-control wait"
DECISION = "decision"
KV_HANDOFF = "kv handoff"
ENGINE_CALLS = ("passthrough", "fallback", "prefill", "decode", "resume", "tokenize")

Value = str | bool | int | float


class Step:
    """A span of one step of a request. This one records nothing (tracing off); its
    ``headers`` are what an engine request carries then: the transport's own."""

    headers = JSON_HEADERS

    def set(self, key: str, value: Value) -> None:
        """Record an attribute of the step."""

    def end(self) -> None:
        """End the step (a ``with`` block ends it on leaving)."""

    def __enter__(self) -> Step:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


class RequestTrace:
    """One request's trace. This one records nothing (tracing off)."""

    trace_id = ""
    # Whether attributes are recorded: a caller that must build them checks it first.
    recording = False

    def step(self, name: str, attributes: Mapping[str, Value] | None = None) -> Step:
        """A child span of the request, started now; end it (or leave its ``with``)."""
        return NO_STEP

    def engine_call(self, role: str, url: str, call: str, **attributes: Value) -> Step:
        """The span of one engine request; its ``headers`` carry the span's context."""
        return NO_STEP

    def set(self, key: str, value: Value) -> None:
        """Record an attribute of the request's server span."""

    def finish(self, status: int, error: str | None = None) -> None:
        """The request was answered with ``status`` (``error``: why it failed)."""


NO_STEP = Step()
NO_TRACE = RequestTrace()
REQUEST_TRACE: web.RequestKey[RequestTrace] = web.RequestKey("syshax.trace", RequestTrace)


class Tracer:
    """Begins a trace per request. This one is tracing off."""

    endpoint: str | None = None

    def begin(self, http: web.Request) -> RequestTrace:
        return NO_TRACE

    def install(self, app: web.Application) -> dict[str, Any]:
        """Hook the app's answers (the trace id header) and return the ``AppRunner``
        arguments for its access log; off, nothing is hooked and nothing is logged."""
        return {"access_log": None}

    def close(self) -> None:
        """Send the spans still queued (bounded wait)."""


OFF = Tracer()


def start(endpoint: str, registry: CollectorRegistry) -> Tracer:
    """The tracer that sends the router's spans to ``endpoint``, counting those dropped in
    ``registry`` (``syshax_router_trace_spans_dropped_total{reason}``)."""
    # lazy: the SDK is loaded only when tracing is on (docs/tracing.md, "Cost")
    from common.tracing import DROP_REASONS
    from common.tracing import start as start_tracing

    dropped = Counter(
        "syshax_router_trace_spans_dropped",
        "Spans that never reached the collector: queue-full (the export queue was full) or "
        "export-failed (the collector did not take them)",
        ["reason"],
        registry=registry,
    )
    for reason in DROP_REASONS:
        dropped.labels(reason)

    def count(reason: str, spans: int) -> None:
        dropped.labels(reason).inc(spans)

    # lazy: the OpenTelemetry-backed trace imports the SDK
    from router.tracing.otel import OtelTracer

    return OtelTracer(start_tracing(SERVICE, endpoint, count))


class TracedAccessLogger(AbstractAccessLogger):
    """One line per answered request, with its trace id (tracing on only): the method, the
    path without its query, the status, the seconds it took and the route it was served on."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        trace = request.get(REQUEST_TRACE)
        self.logger.info(
            "%s %s %d %.3fs route=%s trace_id=%s",
            request.method,
            request.path,
            response.status,
            time,
            response.headers.get("X-Syshax-Route", "-"),
            trace.trace_id if trace is not None and trace.trace_id else "-",
        )
