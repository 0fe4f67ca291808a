"""Tracing on: the OpenTelemetry-backed request trace (``router.tracing`` is the interface
and the path taken when it is off). Imported only by ``router.tracing.start``."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

from aiohttp import web
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context

from common.tracing import TRACEPARENT, Tracing, extract, trace_id_of, traceparent
from router.engines.transport import JSON_HEADERS, UpstreamFailed
from router.tracing import (
    REQUEST_TRACE,
    TRACE_ID_HEADER,
    RequestTrace,
    Step,
    TracedAccessLogger,
    Tracer,
    Value,
    access_log,
)


class OtelTracer(Tracer):
    """A server span per request, continuing the client's ``traceparent`` when it sends a
    valid one."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self.endpoint = tracing.endpoint

    def begin(self, http: web.Request) -> RequestTrace:
        trace = OtelTrace(self.tracing, http)
        http[REQUEST_TRACE] = trace
        return trace

    def install(self, app: web.Application) -> dict[str, Any]:
        app.on_response_prepare.append(_trace_id_header)
        return {"access_log": access_log, "access_log_class": TracedAccessLogger}

    def close(self) -> None:
        self.tracing.shutdown()


async def _trace_id_header(http: web.Request, response: web.StreamResponse) -> None:
    """Every answer to a traced request names its trace, errors included."""
    trace = http.get(REQUEST_TRACE)
    if trace is not None and trace.trace_id:
        response.headers[TRACE_ID_HEADER] = trace.trace_id


class OtelStep(Step):
    def __init__(self, span: Span, headers: bytes = JSON_HEADERS) -> None:
        self.span = span
        self.headers = headers

    def set(self, key: str, value: Value) -> None:
        self.span.set_attribute(key, value)

    def end(self) -> None:
        self.span.end()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            failed(self.span, exc)
        self.span.end()


class OtelTrace(RequestTrace):
    recording = True

    def __init__(self, tracing: Tracing, http: web.Request) -> None:
        self.tracer = tracing.tracer
        self.span = self.tracer.start_span(
            f"{http.method} {http.path}",
            context=extract(http.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": http.method, "url.path": http.path},
        )
        self.context = set_span_in_context(self.span)
        self.trace_id = trace_id_of(self.span)

    def step(self, name: str, attributes: Mapping[str, Value] | None = None) -> Step:
        return OtelStep(self.tracer.start_span(name, context=self.context, attributes=attributes))

    def engine_call(self, role: str, url: str, call: str, **attributes: Value) -> Step:
        span = self.tracer.start_span(
            f"engine {role} {call}",
            context=self.context,
            kind=SpanKind.CLIENT,
            attributes={
                "syshax.engine.role": role,
                "syshax.engine.call": call,
                "syshax.engine.url": url,
                **attributes,
            },
        )
        header = f"{TRACEPARENT}: {traceparent(span)}\r\n".encode("latin-1")
        return OtelStep(span, JSON_HEADERS + header)

    def set(self, key: str, value: Value) -> None:
        self.span.set_attribute(key, value)

    def finish(self, status: int, error: str | None = None) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if error is not None:
            self.span.set_attribute("error.type", error)
            self.span.set_status(StatusCode.ERROR)
        self.span.end()


def failed(span: Span, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``: its kind, and for an engine's failure the router's
    words for it (the engine's URL and what went wrong, never the engine's body)."""
    if isinstance(exc, UpstreamFailed):
        span.set_attribute("error.type", exc.reason)
        span.set_status(StatusCode.ERROR, str(exc)[:300])
        return
    span.set_attribute("error.type", type(exc).__name__)
    span.set_status(StatusCode.ERROR)
