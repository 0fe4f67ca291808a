"""Tracing off costs nothing (docs/tracing.md, "Cost"), and when it is on is the flag's or
the standard variables' say."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.tracing import TracingError, traces_endpoint
from router.engines.transport import JSON_HEADERS
from router.tracing import NO_STEP, NO_TRACE, OFF


@pytest.mark.process
def test_off_the_router_and_the_simulator_load_no_tracing_sdk_or_exporter() -> None:
    # redis-py (the shared limits) loads OpenTelemetry's API and metrics SDK by itself where
    # they are installed; the tracing SDK and the exporter are ours to load, and only when on.
    ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.proto")
    code = (
        "import sys, router.cli, router.request, sim.cli, sim.server; "
        f"print(sorted(m for m in sys.modules if m.startswith({ours!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_off_a_request_shares_one_trace_that_records_nothing() -> None:
    trace = OFF.begin(None)  # type: ignore[arg-type]
    assert trace is NO_TRACE and not trace.recording and trace.trace_id == ""
    assert trace.step("admission") is NO_STEP
    with trace.engine_call("gpu", "http://gpu", "prefill") as call:
        assert call is NO_STEP and call.headers == JSON_HEADERS


@pytest.mark.parametrize(
    ("flag", "environ", "endpoint"),
    [
        (None, {}, None),
        ("http://c:4318/v1/traces", {}, "http://c:4318/v1/traces"),
        ("http://c:4318", {}, "http://c:4318/v1/traces"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}, "http://t:1/x"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318/"}, "http://b:4318/v1/traces"),
        ("http://c:4318", {"OTEL_SDK_DISABLED": "true"}, None),
        ("http://c:4318", {"OTEL_TRACES_EXPORTER": "none"}, None),
    ],
)
def test_the_flag_then_the_standard_variables_name_the_endpoint(
    flag: str | None, environ: dict[str, str], endpoint: str | None
) -> None:
    assert traces_endpoint(flag, environ) == endpoint


def test_an_endpoint_that_is_not_http_is_refused_by_name() -> None:
    with pytest.raises(TracingError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://c:4317"})
