"""The engine scrape: a slow /metrics makes a backend stale (still routed to), a dead or
erroring one makes it down, and what was scraped shows in the router's /health and /metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from router_procs import Proc, metric, wait_for
from test_router_paths import stream_chat

from common.supervisor import free_port
from router.engines.backends import Backend, Timeouts
from router.engines.load import WANTED_METRICS, parse_metrics_text
from router.engines.scrape import scrape

# A vLLM 0.32 engine's gauges and counters, as far as the router reads them.
METRICS_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:kv_cache_usage_perc{model_name="m"} 0.42
vllm:generation_tokens_total{model_name="m"} 1000.0
vllm:inter_token_latency_seconds_sum{model_name="m"} 2.0
vllm:inter_token_latency_seconds_count{model_name="m"} 100.0
"""

SCRAPE_TIMEOUT = 0.2
FAST = Timeouts(scrape=SCRAPE_TIMEOUT)


class FakeEngine:
    """An engine's /metrics whose behaviour a test switches: ok, slow, 500 or garbage."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.url = ""

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "slow":
            # Busy: the answer comes, but well after the scrape gave up.
            await asyncio.sleep(3 * SCRAPE_TIMEOUT)
        if self.mode == "error":
            return web.Response(status=500, text="engine error")
        if self.mode == "garbage":
            return web.Response(body=b"\xff\xfe not prometheus text")
        return web.Response(text=METRICS_PAGE)


@asynccontextmanager
async def fake_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    app = web.Application()
    app.router.add_get("/metrics", engine.metrics)
    runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    engine.url = f"http://{host}:{port}"
    try:
        yield engine
    finally:
        await runner.cleanup()


@asynccontextmanager
async def backend_for(url: str, timeouts: Timeouts = FAST) -> AsyncIterator[Backend]:
    backend = Backend(url, "gpu", timeouts)
    try:
        yield backend
    finally:
        await backend.close()


def run(check: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(check())


def test_a_slow_scrape_makes_the_backend_stale_and_keeps_it_routable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def check() -> None:
        async with fake_engine() as engine, backend_for(engine.url) as backend:
            await scrape(backend)
            first = backend.sample
            assert first is not None and not backend.scrape_view(first.at).stale

            engine.mode = "slow"
            with caplog.at_level(logging.INFO, logger="syshax.router"):
                for _ in range(3):
                    await scrape(backend)
            now = first.at + 1.0
            view = backend.scrape_view(now)
            assert view.stale and backend.up and backend.available(now)
            assert view.last_error == f"timeout: no answer within {SCRAPE_TIMEOUT:g}s"
            assert backend.scrape_failures_in_row == 3
            assert backend.take_scrape_failures() == {"timeout": 3}
            # The decider keeps the last sample (and the router's own in-flight count).
            backend.inflight = 5
            load = backend.load(now)
            assert load.available and load.running == 5 and load.waiting == 2
            assert load.kv_usage_perc == pytest.approx(42.0)
            # The last values stay visible, with their age.
            assert view.running == 3 and view.waiting == 2
            assert view.scrape_age_seconds == pytest.approx(1.0, abs=0.05)
            stale_logs = [r for r in caplog.records if r.name == "syshax.router"]
            assert len(stale_logs) == 1 and stale_logs[0].levelno == logging.WARNING

            engine.mode = "ok"
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="syshax.router"):
                await scrape(backend)
            assert not backend.stale and backend.last_scrape_error is None
            assert backend.scrape_failures_in_row == 0
            assert [r.levelno for r in caplog.records if r.name == "syshax.router"] == [
                logging.INFO
            ]

    run(check)


def test_a_sample_too_old_is_treated_as_missing_but_the_backend_stays_available() -> None:
    async def check() -> None:
        async with fake_engine() as engine, backend_for(engine.url) as backend:
            await scrape(backend, interval=1.0)
            sample = backend.sample
            assert sample is not None
            engine.mode = "slow"
            await scrape(backend, interval=1.0)
            backend.inflight = 1
            # max(10 s, 3 x the 1 s interval) = 10 s
            assert backend.sample_max_age() == 10.0
            assert backend.load(sample.at + 9.9).waiting == 2
            old = backend.load(sample.at + 10.1)
            assert old.available and old.running == 1 and old.waiting == 0
            assert old.kv_usage_perc == 0.0 and old.itl_ms is None
            # A long scrape interval stretches the bound: samples are that old by design.
            backend.scrape_interval = 30.0
            assert backend.sample_max_age() == 90.0
            assert backend.load(sample.at + 60).waiting == 2

    run(check)


def test_a_refused_connection_marks_the_backend_down_at_once() -> None:
    async def check() -> None:
        async with backend_for(f"http://127.0.0.1:{free_port()}") as backend:
            await scrape(backend)
            now = 1e9
            assert not backend.up and not backend.available(now)
            view = backend.scrape_view(now)
            assert not view.stale and view.running is None and view.scrape_age_seconds is None
            assert view.last_error is not None and view.last_error.startswith("connect: ")
            assert backend.take_scrape_failures() == {"connect": 1}
            assert backend.take_scrape_failures() == {}

    run(check)


def test_an_http_error_marks_the_backend_down_and_a_good_scrape_brings_it_back() -> None:
    async def check() -> None:
        async with fake_engine() as engine, backend_for(engine.url) as backend:
            await scrape(backend)
            engine.mode = "error"
            await scrape(backend)
            assert not backend.up and backend.sample is None
            assert backend.last_scrape_error == "http: HTTP 500"
            assert backend.take_scrape_failures() == {"http": 1}
            # A slow scrape does not bring a down backend back, nor make it stale.
            engine.mode = "slow"
            await scrape(backend)
            assert not backend.up and not backend.scrape_view(0.0).stale
            engine.mode = "ok"
            await scrape(backend)
            assert backend.up and backend.sample is not None

    run(check)


def test_an_unreadable_metrics_page_is_stale_not_down() -> None:
    async def check() -> None:
        async with fake_engine() as engine, backend_for(engine.url) as backend:
            engine.mode = "garbage"
            await scrape(backend)
            assert backend.up and backend.stale
            assert backend.take_scrape_failures() == {"parse": 1}
            assert (backend.last_scrape_error or "").startswith("parse: ")

    run(check)


def scraped(router: Proc, role: str) -> dict[str, Any]:
    entry = next(b for b in router.get("/health").json()["backends"] if b["role"] == role)
    result: dict[str, Any] = entry["scrape"]
    return result


def test_health_and_metrics_show_what_was_scraped_from_the_engines(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(
        gpu.url, cpu.url, "--mode", "gpu-only", "--metrics-interval-seconds", "0.2"
    )
    wait_for(lambda: scraped(router, "gpu")["age_seconds"] is not None)
    entry = router.get("/health").json()["backends"][0]
    assert {"url", "role", "up", "ejected", "inflight"} <= set(entry)
    view = entry["scrape"]
    assert set(view) == {
        "running",
        "waiting",
        "kv_usage_perc",
        "throughput_tps",
        "itl_ms",
        "age_seconds",
        "duration_ms",
        "stale",
        "error",
    }
    assert view["running"] == 0 and view["waiting"] == 0
    assert 0.0 <= view["kv_usage_perc"] <= 100.0
    assert view["duration_ms"] > 0 and view["age_seconds"] < 5
    assert view["stale"] is False and view["error"] is None

    # Tokens generated between two scrapes give a throughput and an ITL.
    assert stream_chat(router, 40)[0] == "gpu-only"
    wait_for(lambda: scraped(router, "gpu")["itl_ms"] is not None)
    assert scraped(router, "gpu")["itl_ms"] > 0

    labels = {"backend": gpu.url, "role": "gpu"}
    text = router.get("/metrics").text
    for name in (
        "syshax_router_backend_running",
        "syshax_router_backend_waiting",
        "syshax_router_backend_kv_usage_perc",
        "syshax_router_backend_throughput_tokens_per_second",
        "syshax_router_backend_itl_seconds",
        "syshax_router_backend_scrape_age_seconds",
        "syshax_router_backend_scrape_duration_seconds",
        "syshax_router_backend_stale",
    ):
        assert f'{name}{{backend="{gpu.url}",role="gpu"}}' in text, name
    assert 0 < metric(router, "syshax_router_backend_itl_seconds", **labels) < 1
    assert 0 < metric(router, "syshax_router_backend_scrape_duration_seconds", **labels) < 2
    assert metric(router, "syshax_router_backend_stale", **labels) == 0
    failures = [
        line
        for line in text.splitlines()
        if line.startswith("syshax_router_scrape_failures_total{") and gpu.url in line
    ]
    # Every kind is exported from the start, at zero.
    assert len(failures) == 4 and all(line.endswith(" 0.0") for line in failures)
    for kind in ("timeout", "connect", "http", "parse"):
        assert any(f'kind="{kind}"' in line for line in failures), kind


def test_a_dead_engine_has_no_scraped_values_and_counts_connect_failures(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, _ = engines
    dead = f"http://127.0.0.1:{free_port()}"
    router = router_factory(gpu.url, dead, "--metrics-interval-seconds", "0.2")
    wait_for(lambda: metric(router, "syshax_router_scrape_failures_total", kind="connect") >= 2)
    view = scraped(router, "cpu")
    assert view["running"] is None and view["age_seconds"] is None and not view["stale"]
    assert view["error"].startswith("connect: ")
    text = router.get("/metrics").text
    assert f'syshax_router_backend_running{{backend="{dead}",role="cpu"}}' not in text
    assert f'syshax_router_backend_stale{{backend="{dead}",role="cpu"}} 0.0' in text


def test_a_real_vllm_scrape_reads_as_prometheus_client_reads_it() -> None:
    # The /metrics of a vLLM 0.32 engine (tests/realengine's tiny model, after its PD tests),
    # captured once: our parser (45x faster,
    # docs/decisions/0026-router-parses-engine-metrics.md) must read every family the
    # deciders use exactly as the reference parser does.
    text = (Path(__file__).parent / "data" / "vllm-0.32-metrics.txt").read_text()
    reference: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED_METRICS:
                reference[sample.name] = reference.get(sample.name, 0.0) + sample.value
    sample = parse_metrics_text(text, 1.0)
    assert reference["vllm:generation_tokens_total"] == sample.generation_tokens > 0
    assert reference["vllm:inter_token_latency_seconds_count"] == sample.itl_count > 0
    assert reference["vllm:inter_token_latency_seconds_sum"] == sample.itl_sum
    assert reference["vllm:num_requests_running"] == sample.running
    assert reference["vllm:num_requests_waiting"] == sample.waiting
    assert reference["vllm:kv_cache_usage_perc"] == sample.kv_usage
