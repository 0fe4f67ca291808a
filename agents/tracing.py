"""The agent's span for each command it handles (docs/tracing.md, "The control plane's work").

A command issued by traced work carries that work's ``traceparent`` (the control plane took it
from the span that wrote the command's row). With tracing on, the agent handles the command
inside a span that continues it, and sends its result back with the span's own
``traceparent``: the control plane's span for the result, and the workflow's next step after
it, join the same trace. Tracing is on with ``--otlp-traces-endpoint`` or the standard
``OTEL_EXPORTER_OTLP_*`` variables (common/tracing.py), and off it loads nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from common.tracing import TRACEPARENT, Tracing, extract, start, traceparent

log = logging.getLogger("syshax.agent")

SERVICE = "syshax-agent"
Result = dict[str, Any]


class CommandTracing:
    """Tracing off: a command runs as it is, and its result goes back without a context."""

    def handle(self, message: Mapping[str, Any], run: Callable[[], Result]) -> tuple[Result, str]:
        """``run()``'s result, and the ``traceparent`` to send it back with ("" when off)."""
        return run(), ""

    def shutdown(self) -> None:
        pass


class TracedCommands(CommandTracing):
    """A span per command (kind CONSUMER), a child of the command's ``traceparent``."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def handle(self, message: Mapping[str, Any], run: Callable[[], Result]) -> tuple[Result, str]:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = extract({TRACEPARENT: str(message.get(TRACEPARENT) or "")})
        action = str(message.get("action", ""))
        attributes: dict[str, str | int] = {
            "syshax.dispatch_id": str(message.get("dispatch_id", "")),
            "syshax.command.action": action,
            "syshax.command.attempt": int(message.get("attempt") or 0),
            "syshax.deployment_id": int(message.get("deployment_id") or 0),
            "syshax.generation": int(message.get("generation") or 0),
            "syshax.engine.role": str(message.get("role") or ""),
        }
        with self.tracing.tracer.start_as_current_span(
            f"agent command {action}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        ) as span:
            result = run()
            status = str(result.get("status", ""))
            span.set_attribute("syshax.command.status", status)
            if status != "succeeded":
                # The kind only: a failure's detail may quote an engine's log.
                span.set_status(Status(StatusCode.ERROR, f"command {status}"))
            return result, traceparent(span)

    def shutdown(self) -> None:
        self.tracing.shutdown()


def command_tracing(endpoint: str | None) -> CommandTracing:
    """Spans to ``endpoint`` (resolved by common.tracing.traces_endpoint), or none."""
    if not endpoint:
        return CommandTracing()
    log.info("tracing commands to %s", endpoint)
    return TracedCommands(start(SERVICE, endpoint, _log_dropped))


def _log_dropped(reason: str, count: int) -> None:
    log.warning("%d trace spans dropped (%s)", count, reason)
