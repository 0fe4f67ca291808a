"""Replicas: several deployments of one model on different nodes. A request that fails before
any output moves to another replica, and a deployment that leaves the control plane's set
hands its waiting requests over at once and is closed after its last stream."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_procs import MODEL, Proc, metric, wait_for
from standins import FailingEngine, SilentHost, StandInControlPlane, deployment
from test_router_paths import PROMPT, assert_one_continuous_stream, client, stream_chat

from common.routing import DeploymentSpec
from router.engines.backends import Backend, Timeouts
from router.state import RouterState

# The router scrapes once a minute: it learns that a replica failed only from the requests
# sent to it, as when a host dies between two scrapes.
RARE_SCRAPES = {"mode": "gpu-only", "metrics_interval_seconds": 60}


@pytest.fixture
def standins() -> Iterator[list[Any]]:
    """Stand-ins to close after the test (control planes, engines, silent hosts, routers)."""
    made: list[Any] = []
    yield made
    for thing in reversed(made):
        (thing.stop if isinstance(thing, Proc) else thing.close)()


def wait_scraped(router: Proc, count: int) -> None:
    def scraped() -> bool:
        backends = router.get("/health").json()["backends"]
        return len(backends) == count and all(
            b["scrape"]["age_seconds"] is not None for b in backends
        )

    wait_for(scraped, timeout=10)


def complete(router: Proc, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": "replicas", "max_tokens": max_tokens},
        timeout=30,
    )


@pytest.mark.parametrize("failure", ["refused", "http-500"])
def test_requests_fail_over_to_a_healthy_replica(
    engines: tuple[Proc, Proc], workdir: Path, standins: list[Any], failure: str
) -> None:
    gpu, _ = engines
    broken = FailingEngine()
    standins.append(broken)
    cp = StandInControlPlane(
        [deployment(1, "replica-a", broken.url), deployment(2, "replica-b", gpu.url)],
        **RARE_SCRAPES,
    )
    standins.append(cp)
    router = cp.start_router(workdir, f"replicas-{failure}")
    standins.append(router)
    # Both replicas scraped up; the router routes to the first of equally loaded ones.
    wait_scraped(router, 2)
    if failure == "refused":
        broken.close()  # a GPU-only replica whose engine (or host) is gone: refused
    served_before = metric(gpu, "vllm:request_success_total")

    route, chunks, _ = stream_chat(router, 6)
    assert route == "gpu-only"
    assert_one_continuous_stream(chunks, 6)
    assert complete(router).status_code == 200
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: complete(router), range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    assert all(a.json()["choices"][0]["text"] for a in answers)

    wait_for(lambda: metric(gpu, "vllm:request_success_total") - served_before == 10)
    assert metric(router, "syshax_router_requests_total", outcome="ok") == 10
    reason = "connect" if failure == "refused" else "http"
    failovers = metric(router, "syshax_router_failovers_total", reason=reason)
    assert failovers >= 1
    assert metric(router, "syshax_router_failovers_total") == failovers
    if failure == "http-500":
        assert broken.posts == failovers


@pytest.mark.process
def test_when_every_replica_fails_the_client_gets_one_openai_error(
    workdir: Path, standins: list[Any]
) -> None:
    broken = [FailingEngine() for _ in range(4)]
    standins.extend(broken)
    cp = StandInControlPlane(
        [deployment(i + 1, f"replica-{i}", e.url) for i, e in enumerate(broken)], **RARE_SCRAPES
    )
    standins.append(cp)
    router = cp.start_router(workdir, "replicas-all-failing")
    standins.append(router)
    wait_scraped(router, 4)

    resp = complete(router)
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("service_unavailable", "backend_unavailable")
    assert "HTTP 500" in error["message"] and "3 replicas tried" in error["message"]
    # The first replica and at most two more; the fourth is never tried.
    assert sum(e.posts for e in broken) == 3
    assert metric(router, "syshax_router_failovers_total", reason="http") == 2


def test_a_request_waiting_on_a_removed_silent_replica_completes_on_another(
    engines: tuple[Proc, Proc], workdir: Path, standins: list[Any]
) -> None:
    gpu, cpu = engines
    lost_gpu, lost_cpu = SilentHost(), SilentHost()
    standins.extend([lost_gpu, lost_cpu])
    alive = deployment(2, "alive", gpu.url, cpu.url)
    cp = StandInControlPlane(
        [deployment(1, "lost", lost_gpu.url, lost_cpu.url), alive], mode="gpu-only"
    )
    standins.append(cp)
    router = cp.start_router(workdir, "replicas-silent")
    standins.append(router)
    wait_for(lambda: len(router.get("/health").json()["backends"]) == 4, timeout=10)

    # The lost replica is listed first and nothing weighs on it: the request waits there,
    # on a host that went silent (no RST), for up to the 120 s first-byte timeout.
    result: dict[str, Any] = {}

    def send() -> None:
        result["answer"] = stream_chat(router, 8)

    client = threading.Thread(target=send)
    client.start()
    wait_for(lambda: lost_gpu.completions_seen() == 1, timeout=5)
    removed = time.monotonic()
    cp.set_deployments([alive])  # the control plane no longer lists the lost node's pair
    client.join(timeout=20)
    took = time.monotonic() - removed
    assert not client.is_alive(), "the request still waits on the removed replica"
    route, chunks, _ = result["answer"]
    assert route == "gpu-only"
    assert_one_continuous_stream(chunks, 8)
    assert took < 5, f"took {took:.1f}s after the removal"
    print(f"served by the other replica {took:.2f} s after the removal")
    assert metric(router, "syshax_router_failovers_total", reason="removed") == 1
    assert metric(router, "syshax_router_requests_total", outcome="ok") == 1

    # Nothing is left on the removed backends: they are closed, not kept until shutdown.
    health = wait_for(lambda: (h := router.get("/health").json())["closing"] == [] and h)
    assert sorted(b["url"] for b in health["backends"]) == sorted([gpu.url, cpu.url])
    wait_for(lambda: lost_gpu.open == 0 and lost_cpu.open == 0, timeout=5)
    assert "left the deployment set: 1 of its 1 requests had sent no output" in router.log_text()


def test_a_stream_under_way_on_a_removed_replica_finishes_there_then_it_closes(
    engines: tuple[Proc, Proc], slow_cpu: Proc, workdir: Path, standins: list[Any]
) -> None:
    gpu, _ = engines
    alive = deployment(2, "alive", gpu.url)
    # A slow engine (2x) as the first replica's GPU, so the stream is still going on removal.
    cp = StandInControlPlane([deployment(1, "leaving", slow_cpu.url), alive], mode="gpu-only")
    standins.append(cp)
    router = cp.start_router(workdir, "replicas-draining")
    standins.append(router)
    wait_for(lambda: len(router.get("/health").json()["backends"]) == 2, timeout=10)

    chunks = []
    with client(router).chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=PROMPT,
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        for chunk in raw.parse():
            chunks.append(chunk)
            if len(chunks) == 5:
                cp.set_deployments([alive])
                closing = wait_for(lambda: router.get("/health").json()["closing"])
                assert closing == [{"url": slow_cpu.url, "role": "gpu", "inflight": 1}]
    assert_one_continuous_stream(chunks, 60)
    assert metric(router, "syshax_router_failovers_total") == 0
    wait_for(lambda: router.get("/health").json()["closing"] == [])
    assert "left the deployment set: 0 of its 1 requests had sent no output" in router.log_text()


def spec(ident: int, port: int) -> DeploymentSpec:
    return DeploymentSpec(
        ident, f"d{ident}", "m", "default", "vllm", f"http://127.0.0.1:{port}", None
    )


class Request:
    """What a backend sees of a request: whether it already sent output."""

    def __init__(self, started_output: bool) -> None:
        self.started_output = started_output
        self.handed_over = False

    def backend_removed(self, backend: Backend) -> bool:
        if self.started_output:
            return False
        self.handed_over = True
        return True


def test_a_backend_leaving_the_set_hands_over_waiting_requests_and_closes_after_streams() -> None:
    async def check() -> None:
        state = RouterState(Timeouts())
        state.set_deployments([spec(1, 9001), spec(2, 9002)])
        try:
            gone = state.by_model["m"][0].gpu
            streaming, waiting = Request(started_output=True), Request(started_output=False)
            holds = {r: gone.holding(r) for r in (streaming, waiting)}
            for hold in holds.values():
                hold.__enter__()
            state.set_deployments([spec(2, 9002)])
            assert waiting.handed_over and not streaming.handed_over
            assert state.closing == [gone] and list(state.backends) == ["http://127.0.0.1:9002"]
            assert gone.pool.closed and not gone.available(time.monotonic())
            holds[waiting].__exit__(None, None, None)
            await asyncio.sleep(0.05)
            assert not gone.closed, "closed under a stream still on it"
            holds[streaming].__exit__(None, None, None)
            for _ in range(50):
                if not state.closing:
                    break
                await asyncio.sleep(0.01)
            assert state.closing == [] and gone.closed
            # A request that failed on replica 2 finds no other one.
            assert state.choose("m", exclude={2}) is None
            assert state.choose("m", exclude={1}) is state.by_model["m"][0]
        finally:
            await state.close()

    asyncio.run(check())
