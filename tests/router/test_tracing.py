"""One trace per request across the router and both engines (docs/tracing.md): a PD request
with a client's ``traceparent`` gives one trace holding the router's spans and each
simulated engine's ``llm_request`` span under the router's call to it; a malformed
``traceparent`` starts a new trace; a collector that refuses connections costs the request
nothing and its spans are counted as dropped."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from router_procs import MODEL, Proc, dead_url, metric, start_router, start_sim, wait_for

pytestmark = pytest.mark.process

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SECRET_PROMPT = "the launch code is swordfish"


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class Collector:
    """An OTLP/HTTP receiver on its own thread: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.bodies: list[bytes] = []
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.ready.set()
        self.loop.run_forever()

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        export = ExportTraceServiceRequest.FromString(body)
        found = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        Span(
                            service=str(resource.get("service.name")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(found)
            self.bodies.append(body)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


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
