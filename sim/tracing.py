"""The span the simulator emits per request, as vLLM 0.32 does with ``--otlp-traces-endpoint``
(docs/tracing.md, "The engines' spans").

vLLM ends a request's ``llm_request`` span (kind SERVER) when the request finishes, started
at its arrival, as a child of the ``traceparent`` the request came with (a new trace
without one), with its latencies and usage under the ``gen_ai.*`` keys its
``SpanAttributes`` names. The simulator's is the same span from its own clock: times are
wall seconds (simulated seconds divided by ``--speed``), like the timings of
``/sim/requests``. Without the flag nothing is imported or emitted; a request that carries
a ``traceparent`` then gets one warning in the log, as vLLM gives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from common.tracing import TRACEPARENT, extract, start
from sim.scheduler import Sequence

log = logging.getLogger("sim")

SPAN_NAME = "llm_request"
SERVICE = "syshax-sim"
# vLLM's attribute keys (its SpanAttributes), and the request fields it copies when set.
REQUEST_ID = "gen_ai.request.id"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
REQUEST_FIELDS = {
    "top_p": "gen_ai.request.top_p",
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "n": "gen_ai.request.n",
}


class EngineTracing:
    """Tracing off: requests are not traced (one warning for a traced request)."""

    warned = False

    def finished(
        self,
        headers: Mapping[str, str],
        seq: Sequence,
        body: Mapping[str, Any],
        epoch_of: Callable[[float], float],
    ) -> None:
        """``seq``, sent with ``headers`` and ``body``, finished; ``epoch_of`` turns its
        simulated times into wall-clock seconds since the epoch."""
        if not self.warned and TRACEPARENT in headers:
            self.warned = True
            log.warning("Received a request with trace context but tracing is disabled")

    def close(self) -> None:
        """Send the spans still queued (bounded wait)."""


class OtelEngineTracing(EngineTracing):
    """Tracing on: an ``llm_request`` span per finished request."""

    def __init__(self, endpoint: str) -> None:
        # The SDK is loaded here, only with --otlp-traces-endpoint.
        from opentelemetry.trace import SpanKind

        self.server = SpanKind.SERVER
        self.tracing = start(SERVICE, endpoint, self._dropped)

    def _dropped(self, reason: str, spans: int) -> None:
        log.warning("%d span(s) not sent to %s (%s)", spans, self.tracing.endpoint, reason)

    def finished(
        self,
        headers: Mapping[str, str],
        seq: Sequence,
        body: Mapping[str, Any],
        epoch_of: Callable[[float], float],
    ) -> None:
        now = time.time()
        span = self.tracing.tracer.start_span(
            SPAN_NAME,
            context=extract(headers),
            kind=self.server,
            attributes=request_attributes(seq, body, epoch_of, now),
            start_time=int(epoch_of(seq.arrival) * 1e9),
        )
        span.end(end_time=int(now * 1e9))

    def close(self) -> None:
        self.tracing.shutdown()


def request_attributes(
    seq: Sequence, body: Mapping[str, Any], epoch_of: Callable[[float], float], now: float
) -> dict[str, Any]:
    """vLLM's attributes of a finished request: its id, usage and latencies (seconds), and
    the sampling fields it was sent with, where set. Never its prompt or its text."""
    arrival = epoch_of(seq.arrival)
    scheduled = epoch_of(seq.scheduled_at) if seq.scheduled_at is not None else arrival
    first = epoch_of(seq.first_token_at) if seq.first_token_at is not None else now
    last = epoch_of(seq.last_token_at) if seq.last_token_at is not None else now
    attributes: dict[str, Any] = {
        TIME_TO_FIRST_TOKEN: first - arrival,
        E2E: now - arrival,
        TIME_IN_QUEUE: scheduled - arrival,
        PROMPT_TOKENS: seq.prompt_tokens + seq.resumed_tokens,
        COMPLETION_TOKENS: seq.generated,
        TIME_IN_MODEL_PREFILL: first - scheduled,
        TIME_IN_MODEL_DECODE: last - first,
        TIME_IN_MODEL_INFERENCE: last - scheduled,
        REQUEST_ID: seq.request_id,
    }
    for field, key in REQUEST_FIELDS.items():
        value = body.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool) and value:
            attributes[key] = value
    return attributes


def engine_tracing(endpoint: str | None) -> EngineTracing:
    """Tracing to ``endpoint``, or off (None)."""
    return OtelEngineTracing(endpoint) if endpoint else EngineTracing()
