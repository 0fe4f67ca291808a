"""OpenTelemetry tracing as the router and the simulator both set it up (docs/tracing.md).

Tracing is off unless an OTLP/HTTP traces endpoint is named: the ``--otlp-traces-endpoint``
flag (vLLM's name), else the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
keep it off. ``traces_endpoint`` decides that without importing the SDK: the SDK is imported
only by ``start``, so a process with tracing off never loads it.

Spans leave through the SDK's ``BatchSpanProcessor``, on its own thread, behind a bounded
queue: a collector that is down, slow or refusing costs the request path nothing. A span
that finds the queue full is dropped and counted (``queue-full``), and so are the spans of
an export the collector did not take (``export-failed``). The rest of the SDK's settings are
its own ``OTEL_*`` variables (service name and resource, headers, timeout, compression,
sampler, ``OTEL_BSP_*``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, Span, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Tracer

TRACES_PATH = "/v1/traces"
TRACEPARENT = "traceparent"
# Why a span never reached the collector: the label of the dropped-spans counter.
DROP_QUEUE_FULL = "queue-full"
DROP_EXPORT_FAILED = "export-failed"
DROP_REASONS = (DROP_QUEUE_FULL, DROP_EXPORT_FAILED)
# Spans held for export at most (the SDK's OTEL_BSP_MAX_QUEUE_SIZE, whose default it is).
DEFAULT_QUEUE = 2048
# Seconds a stopping process waits for its last spans to leave.
SHUTDOWN_WAIT = 2.0

# Counts spans that never reached the collector: (reason, how many).
DropCounter = Callable[[str, int], None]


class TracingError(ValueError):
    """Tracing cannot start as configured; the message names the flag or variable."""


def traces_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP/HTTP traces URL tracing sends to, or None when tracing is off.

    The flag wins, then ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (a full URL, as the SDK takes
    it), then ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL: ``/v1/traces`` is added). A flag
    or signal URL with no path gets ``/v1/traces`` too. Raises ``TracingError`` for a URL
    that is not http(s)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    name, url = "--otlp-traces-endpoint", flag
    if not url:
        name = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        url = environ.get(name, "").strip()
    if not url:
        name = "OTEL_EXPORTER_OTLP_ENDPOINT"
        base = environ.get(name, "").strip()
        url = base.rstrip("/") + TRACES_PATH if base else ""
    if not url:
        return None
    return checked_endpoint(url, name)


def checked_endpoint(url: str, name: str) -> str:
    """``url`` as the OTLP/HTTP traces URL it names (``/v1/traces`` added to a URL with no
    path); ``TracingError`` naming ``name`` for one that is not http(s)."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        parts = parts._replace(netloc="")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingError(f"{name} must be an http(s) URL of an OTLP/HTTP collector; got {url!r}")
    return url if parts.path not in ("", "/") else url.rstrip("/") + TRACES_PATH


@dataclass(frozen=True)
class Tracing:
    """A started tracer: its spans go to ``endpoint`` until ``shutdown``."""

    tracer: Tracer
    provider: TracerProvider
    endpoint: str

    def shutdown(self, wait: float = SHUTDOWN_WAIT) -> None:
        """Send what is queued, waiting at most ``wait`` seconds (a silent collector must
        not hold a stopping process)."""
        done = threading.Thread(target=self.provider.shutdown, daemon=True)
        done.start()
        done.join(wait)


def start(service: str, endpoint: str, dropped: DropCounter) -> Tracing:
    """A tracer whose spans leave for ``endpoint`` in batches, on the SDK's thread.
    ``service`` is the service name unless ``OTEL_SERVICE_NAME`` or the resource attributes
    name one."""
    # The SDK is loaded here only, when tracing is on (docs/tracing.md, "Cost").
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The operator's OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over ``service``.
    resource = Resource.create({"service.name": service}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    exporter = _counting_exporter(OTLPSpanExporter(endpoint=endpoint), dropped)
    bound = _queue_bound()
    batches = BatchSpanProcessor(exporter, max_queue_size=bound)
    provider.add_span_processor(_bounded(batches, bound, exporter, dropped))
    return Tracing(provider.get_tracer("syshax"), provider, endpoint)


def _queue_bound() -> int:
    text = os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "").strip()
    if not text:
        return DEFAULT_QUEUE
    try:
        bound = int(text)
    except ValueError:
        raise TracingError(
            f"OTEL_BSP_MAX_QUEUE_SIZE must be a whole number; got {text!r}"
        ) from None
    if bound < 1:
        raise TracingError(f"OTEL_BSP_MAX_QUEUE_SIZE must be at least 1; got {bound}")
    return bound


class _Counting:
    """An exporter that counts the spans handed to it, and those of a failed export."""

    def __init__(self, inner: SpanExporter, dropped: DropCounter) -> None:
        self.inner = inner
        self.dropped = dropped
        self.lock = threading.Lock()
        self.taken = 0  # spans the batch processor has handed over so far

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self.lock:
            self.taken += len(spans)
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter's failure must not stop the batch thread
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.dropped(DROP_EXPORT_FAILED, len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _counting_exporter(inner: SpanExporter, dropped: DropCounter) -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter

    class CountingExporter(_Counting, SpanExporter):
        pass

    return CountingExporter(inner, dropped)


def _bounded(batches: Any, bound: int, exporter: _Counting, dropped: DropCounter) -> Any:
    """A span processor in front of ``batches`` that holds its queue under ``bound``: a span
    that would overflow it is dropped here, where it is counted, instead of pushing out the
    oldest span inside the SDK, where it is not. (Spans in a batch being handed over count
    as queued for a moment: the bound errs on the side of dropping one early.)"""
    from opentelemetry.sdk.trace import SpanProcessor

    class BoundedProcessor(SpanProcessor):
        def __init__(self) -> None:
            self.ended = 0  # spans passed to the batch processor

        def on_start(self, span: Span, parent_context: Context | None = None) -> None:
            batches.on_start(span, parent_context=parent_context)

        def on_end(self, span: ReadableSpan) -> None:
            with exporter.lock:
                if self.ended - exporter.taken >= bound:
                    full = True
                else:
                    full = False
                    self.ended += 1
            if full:
                dropped(DROP_QUEUE_FULL, 1)
                return
            batches.on_end(span)

        def shutdown(self) -> None:
            batches.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(batches.force_flush(timeout_millis))

    return BoundedProcessor()


def extract(headers: Mapping[str, str]) -> Context:
    """The W3C trace context a request carries (``traceparent``, ``tracestate``); an empty
    context, so a new trace, when it carries none or a malformed one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def traceparent(span: Any) -> str:
    """The ``traceparent`` value that makes a callee's span a child of ``span``."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def trace_id_of(span: Any) -> str:
    """``span``'s trace id, 32 hex digits (as trace viewers show it)."""
    from opentelemetry.trace import format_trace_id

    return format_trace_id(span.get_span_context().trace_id)
