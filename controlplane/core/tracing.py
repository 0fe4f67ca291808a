"""The control plane's own traces (docs/tracing.md, "The control plane's work").

Off unless ``settings.TRACES_ENDPOINT`` names a collector (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_ENDPOINT``). Then :func:`start` sets a tracer provider and the
maintained instrumentations: Django (a server span per API call, continuing a caller's
``traceparent``), Celery (a span per published and per run task, the context carried in the
task's headers) and httpx (the batch worker's requests to the router carry the context on).
A deployment's workflow crosses one more hop the instrumentations do not see, the
:class:`~controlplane.deployments.models.AgentCommand` row an agent fetches: its
``traceparent`` is taken from the current span when the row is written
(:func:`current_traceparent`), and the agent's command span continues it.

Off, nothing here imports OpenTelemetry: the helpers below return at once.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from django.conf import settings

from common.tracing import Tracing
from common.tracing import start as start_tracer

log = logging.getLogger(__name__)

SERVICE = "syshax-controlplane"
# Requests that are polled, not worked on: a trace each would bury the workflow's traces.
# OTEL_PYTHON_DJANGO_EXCLUDED_URLS replaces the list.
POLLED_URLS = ",".join(
    (
        r"api/v1/agent/commands",
        r"api/v1/nodes/\d+/heartbeat",
        r"api/v1/routers/\d+/stats",
        r"api/v1/routing/",
        r"metrics",
        r"healthz",
    )
)

_started: Tracing | None = None
_lock = threading.Lock()
_dropped = {"count": 0}


def enabled() -> bool:
    return _started is not None


def start() -> Tracing | None:
    """Start tracing once per process when an endpoint is configured; None when off."""
    global _started
    endpoint = getattr(settings, "TRACES_ENDPOINT", None)
    if not endpoint:
        return None
    with _lock:
        if _started is None:
            _started = _instrument(endpoint)
    return _started


def _instrument(endpoint: str) -> Tracing:
    import os

    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    tracing = start_tracer(SERVICE, endpoint, _count_dropped)
    trace.set_tracer_provider(tracing.provider)
    excluded = os.environ.get("OTEL_PYTHON_DJANGO_EXCLUDED_URLS") or POLLED_URLS
    DjangoInstrumentor().instrument(tracer_provider=tracing.provider, excluded_urls=excluded)
    CeleryInstrumentor().instrument(tracer_provider=tracing.provider)
    HTTPXClientInstrumentor().instrument(tracer_provider=tracing.provider)
    atexit.register(tracing.shutdown)
    log.info("tracing to %s", endpoint)
    return tracing


def stop() -> None:
    """Undo :func:`start`: the instrumentations removed, the last spans sent (a test's end)."""
    global _started
    with _lock:
        if _started is None:
            return
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.instrumentation.django import DjangoInstrumentor
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

        for instrumentor in (DjangoInstrumentor(), CeleryInstrumentor(), HTTPXClientInstrumentor()):
            instrumentor.uninstrument()
        _started.shutdown()
        _started = None


def _count_dropped(reason: str, count: int) -> None:
    # The control plane has no per-process metrics registry a scrape reaches: the log says.
    _dropped["count"] += count
    log.warning("%d trace spans dropped (%s); %d so far", count, reason, _dropped["count"])


def current_traceparent() -> str:
    """The W3C ``traceparent`` of the current span, to hand to a hop the instrumentations do
    not cross (an agent's command); "" when tracing is off or no span is current."""
    if _started is None:
        return ""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent", "")


def current_trace_id() -> str:
    """The current span's trace id (32 hex digits), "" when off or none is current."""
    if _started is None:
        return ""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else ""


def with_trace_id(detail: dict[str, Any]) -> dict[str, Any]:
    """``detail`` naming the current trace (``trace_id``) when tracing is on: an event or a
    row written by traced work points at the trace that wrote it."""
    trace_id = current_trace_id()
    return {"trace_id": trace_id, **detail} if trace_id else detail


def annotate(**attributes: Any) -> None:
    """Name what the current span worked on (``syshax.<key>``): a deployment, a run, a batch.
    Nothing when tracing is off."""
    if _started is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(f"syshax.{key}", value)


def trace_url(trace_id: str) -> str:
    """Where the operator's viewer shows ``trace_id`` (``SYSHAX_TRACE_URL_TEMPLATE``), or ""."""
    template: str = getattr(settings, "TRACE_URL_TEMPLATE", "")
    if not template or not trace_id:
        return ""
    return template.replace("{trace_id}", trace_id)
