"""One trace per request across the router and both engines (docs/tracing.md): a PD request
with a client's ``traceparent`` gives one trace holding the router's spans and each
simulated engine's ``llm_request`` span under the router's call to it; a malformed
``traceparent`` starts a new trace; a collector that refuses connections costs the request
nothing and its spans are counted as dropped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_procs import MODEL, Proc, dead_url, metric, start_router, start_sim, wait_for

from tests.support.otlp import Collector, Span

pytestmark = pytest.mark.process

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SECRET_PROMPT = "the launch code is swordfish"


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    receiver = Collector()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, collector: Collector
) -> Iterator[tuple[Proc, Proc, Path]]:
    """A GPU and a CPU engine sharing a KV handoff directory, both tracing to the
    collector, their spans sent within 100 ms."""
    workdir = tmp_path_factory.mktemp("tracing")
    (workdir / "shm").mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        tracing = ("--otlp-traces-endpoint", collector.url)
        gpu = start_sim("gpu", "h100-80gb", workdir, workdir / "shm", 20, *tracing)
        try:
            cpu = start_sim("cpu", "kunpeng-920-7280z", workdir, workdir / "shm", 20, *tracing)
        except Exception:
            gpu.stop()
            raise
        yield gpu, cpu, workdir
    cpu.stop()
    gpu.stop()


def _router(workdir: Path, name: str, gpu: Proc, cpu: Proc, endpoint: str, *extra: str) -> Proc:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
        return start_router(
            name,
            workdir,
            gpu.url,
            cpu.url,
            "--mode",
            "forced-pd",
            "--otlp-traces-endpoint",
            endpoint,
            *extra,
        )


def _chat(router: Proc, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": SECRET_PROMPT}],
            "max_tokens": 12,
            "temperature": 0.5,
        },
        headers=headers,
        timeout=30,
    )


def test_a_pd_request_is_one_trace_across_the_router_and_both_engines(
    traced: tuple[Proc, Proc, Path], collector: Collector
) -> None:
    gpu, cpu, workdir = traced
    router = _router(workdir, "router-traced", gpu, cpu, collector.url)
    try:
        resp = _chat(router, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Syshax-Route"] == "pd"
        assert resp.headers["X-Syshax-Trace-Id"] == CLIENT_TRACE

        def complete() -> list[Span] | None:
            spans = collector.trace(CLIENT_TRACE)
            names = {s.name for s in spans}
            wanted = {"engine gpu prefill", "engine cpu decode", "kv handoff", "llm_request"}
            done = wanted <= names and sum(s.name == "llm_request" for s in spans) == 2
            return spans if done else None

        spans = wait_for(complete, timeout=15)
        by_name = {s.name: s for s in spans if s.name != "llm_request"}
        server = by_name["POST /v1/chat/completions"]
        assert server.service == "syshax-router"
        assert server.parent_id == CLIENT_SPAN  # the client's trace, continued
        assert server.attributes["http.response.status_code"] == 200
        assert server.attributes["syshax.route"] == "pd"
        for name in ("admission", "decision", "engine gpu prefill", "engine cpu decode"):
            assert by_name[name].parent_id == server.span_id, name
        assert by_name["kv handoff"].parent_id == server.span_id
        decision = by_name["decision"].attributes
        assert decision["syshax.route"] == "pd"
        assert decision["syshax.decision.step"] == "mode-forced-pd"
        assert decision["syshax.decision.code"] == resp.headers["X-Syshax-Reason"]
        assert by_name["admission"].attributes["syshax.slo_class"] == "standard"
        handoff = by_name["kv handoff"].attributes
        assert handoff["syshax.kv.outcome"] == "hit"
        assert handoff["syshax.kv.tokens"] > 0

        # Each engine's span is a child of the router's call to that engine.
        engines = [s for s in spans if s.name == "llm_request"]
        assert {s.service for s in engines} == {"syshax-sim"}
        parents = {s.parent_id: s for s in engines}
        prefill = parents[by_name["engine gpu prefill"].span_id].attributes
        decode = parents[by_name["engine cpu decode"].span_id].attributes
        assert prefill["gen_ai.usage.completion_tokens"] == 1
        assert prefill["gen_ai.request.temperature"] == 0.5
        assert decode["gen_ai.usage.completion_tokens"] == 11
        for attributes in (prefill, decode):
            for key in (
                "gen_ai.request.id",
                "gen_ai.usage.prompt_tokens",
                "gen_ai.latency.time_to_first_token",
                "gen_ai.latency.e2e",
                "gen_ai.latency.time_in_queue",
                "gen_ai.latency.time_in_model_prefill",
                "gen_ai.latency.time_in_model_decode",
                "gen_ai.latency.time_in_model_inference",
            ):
                assert key in attributes, key

        # No span anywhere carries the prompt (or the text); the access log has the trace id.
        with collector.lock:
            assert not any(SECRET_PROMPT.encode() in body for body in collector.bodies)
        wait_for(lambda: f"trace_id={CLIENT_TRACE}" in router.log_text(), timeout=5)
    finally:
        router.stop()


def test_a_malformed_traceparent_starts_a_new_trace(
    traced: tuple[Proc, Proc, Path], collector: Collector
) -> None:
    gpu, cpu, workdir = traced
    router = _router(workdir, "router-malformed", gpu, cpu, collector.url)
    try:
        resp = _chat(router, {"traceparent": "00-not-a-trace-id-01"})
        assert resp.status_code == 200, resp.text
        trace_id = resp.headers["X-Syshax-Trace-Id"]
        assert len(trace_id) == 32 and trace_id != CLIENT_TRACE

        def server() -> Span | None:
            found = [s for s in collector.trace(trace_id) if s.name.startswith("POST ")]
            return found[0] if found else None

        assert wait_for(server, timeout=15).parent_id == ""
    finally:
        router.stop()


def test_a_refusing_collector_neither_fails_nor_delays_a_request(
    traced: tuple[Proc, Proc, Path],
) -> None:
    gpu, cpu, workdir = traced
    refusing = _router(workdir, "router-refused", gpu, cpu, dead_url())
    try:
        # The first request warms the connections; the next ones are timed.
        assert _chat(refusing, {}).status_code == 200
        times = []
        for _ in range(5):
            started = time.perf_counter()
            resp = _chat(refusing, {})
            times.append(time.perf_counter() - started)
            assert resp.status_code == 200, resp.text
            assert resp.headers["X-Syshax-Route"] == "pd"
        # A forced-pd request of 12 tokens on engines 20x faster than real: well under a
        # second, where an export waiting on the collector would take its 1 s timeout.
        assert sorted(times)[2] < 1.0, times
        wait_for(
            lambda: (
                metric(refusing, "syshax_router_trace_spans_dropped_total", reason="export-failed")
                > 0
            ),
            timeout=20,
        )
    finally:
        refusing.stop()
