"""SLO classes and flow control through a router process (docs/slo-classes.md): what the
engines receive for each class (priority only where they schedule by it, never
service_tier), the refusals a client sees, and requests that wait in the router's queues
while the engines are saturated, time out there, or leave."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from recording_engine import RecordingEngine
from router_procs import MODEL, Proc, metric, wait_for
from standins import StandInControlPlane, deployment

from common.tenants import hash_key

pytestmark = pytest.mark.process  # routers and stand-in engines

CHAT = [{"role": "user", "content": "hello"}]
JOBS_KEY = "sk-shx-jobs"


@pytest.fixture
def stubs() -> Iterator[tuple[RecordingEngine, RecordingEngine]]:
    gpu, cpu = RecordingEngine(), RecordingEngine()
    yield gpu, cpu
    gpu.close()
    cpu.close()


def chat(
    router: Proc,
    key: str | None = None,
    timeout: float = 30,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> httpx.Response:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **extra}
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=sent, timeout=timeout)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def completions(engine: RecordingEngine) -> list[dict[str, Any]]:
    return [r.body for r in engine.requests() if r.path.endswith("completions")]


def send_each_class(router: Proc) -> None:
    # flex: batch, served whole on the (idle, unmeasured) CPU: its one probe request.
    assert chat(router, service_tier="flex", priority=-3).status_code == 200
    # priority: interactive, on the idle GPU alone.
    assert chat(router, service_tier="priority").status_code == 200
    # No tier: the tenant's default class, standard.
    assert chat(router).status_code == 200


def test_the_engines_get_the_class_priority_only_where_they_schedule_by_it(
    workdir: Path, stubs: tuple[RecordingEngine, RecordingEngine]
) -> None:
    gpu, cpu = stubs
    cp = StandInControlPlane(
        [{**deployment(1, "d", gpu.url, cpu.url), "priority_scheduling": True}]
    )
    router = cp.start_router(workdir, "priority-router")
    try:
        wait_for(lambda: len(router.get("/health").json()["backends"]) == 2, timeout=10)
        send_each_class(router)
        decisions = "syshax_router_class_decisions_total"
        assert metric(router, decisions, **{"class": "batch", "reason": "class-cpu-only"}) == 1
        assert metric(router, decisions, **{"class": "interactive", "route": "gpu-only"}) == 1
        assert metric(router, decisions, **{"class": "standard", "route": "gpu-only"}) == 1
    finally:
        router.stop()
        cp.close()
    on_gpu, on_cpu = completions(gpu), completions(cpu)
    assert all("service_tier" not in body for body in on_gpu + on_cpu)
    # Interactive then standard on the GPU; the batch request whole on the CPU.
    assert [body["priority"] for body in on_gpu] == [0, 1]
    assert [body["priority"] for body in on_cpu] == [2]
    assert "kv_transfer_params" not in on_cpu[0]


def test_engines_without_priority_scheduling_get_no_priority_field(
    stubs: tuple[RecordingEngine, RecordingEngine], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = stubs
    router = router_factory(gpu.url, cpu.url)
    send_each_class(router)
    sent = completions(gpu) + completions(cpu)
    assert len(sent) == 3
    assert all("priority" not in body and "service_tier" not in body for body in sent)
    # An unknown tier or class header is a 400 naming it; no engine sees the request.
    error = error_of(chat(router, service_tier="turbo"), 400)
    assert (error["param"], error["code"]) == ("service_tier", "invalid_service_tier")
    error = error_of(chat(router, headers={"X-Syshax-Class": "gold"}), 400)
    assert (error["param"], error["code"]) == ("X-Syshax-Class", "invalid_class")
    assert len(completions(gpu) + completions(cpu)) == 3


def test_a_tenant_gets_only_its_classes(
    workdir: Path,
    stubs: tuple[RecordingEngine, RecordingEngine],
    router_factory: Callable[..., Proc],
) -> None:
    gpu, cpu = stubs
    tenants = workdir / "class-tenants.json"
    jobs = {
        "name": "jobs",
        "keys": [hash_key(JOBS_KEY)],
        "classes": ["batch"],
        "default_class": "batch",
    }
    tenants.write_text(json.dumps({"tenants": [jobs]}))
    router = router_factory(gpu.url, cpu.url, "--tenants-file", str(tenants))
    error = error_of(chat(router, JOBS_KEY, service_tier="priority"), 403)
    assert error["code"] == "class_not_allowed" and "interactive" in error["message"]
    error = error_of(chat(router, JOBS_KEY, headers={"X-Syshax-Class": "standard"}), 403)
    assert error["code"] == "class_not_allowed"
    assert chat(router, JOBS_KEY).status_code == 200  # its default class, batch
    assert chat(router, JOBS_KEY, service_tier="flex").status_code == 200


def test_requests_wait_while_the_engines_are_saturated(
    stubs: tuple[RecordingEngine, RecordingEngine], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = stubs
    # Both engines past every limit, and the GPU's own queue at max_queue_size.
    gpu.running, gpu.waiting, cpu.running = 50, 3, 50
    router = router_factory(
        gpu.url,
        cpu.url,
        "--max-queue-size",
        "3",
        "--metrics-interval-seconds",
        "0.1",
        "--batch-ttft-ms",
        "1000",
    )
    wait_for(lambda: router.get("/health").json()["backends"][0]["scrape"]["running"] == 50)
    depth = "syshax_router_queue_depth"

    # A batch request waits up to its TTFT target, then gets a 429 with Retry-After.
    late = chat(router, service_tier="flex")
    error = error_of(late, 429)
    assert error["code"] == "queue_timeout" and late.headers["retry-after"]
    assert (
        metric(router, "syshax_router_shed_total", **{"class": "batch", "reason": "timeout"}) == 1
    )

    # A client that leaves while it waits leaves the queue.
    with pytest.raises(httpx.TimeoutException):
        chat(router, timeout=0.5)
    wait_for(lambda: metric(router, depth, **{"class": "standard"}) == 0)

    # A waiting request is served once the engines have room.
    answers: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answers.append(chat(router)))
    waiting.start()
    wait_for(lambda: metric(router, depth, **{"class": "standard"}) == 1)
    assert completions(gpu) == []
    gpu.running = gpu.waiting = cpu.running = 0
    waiting.join(timeout=10)
    assert answers and answers[0].status_code == 200, answers
    assert metric(router, depth, **{"class": "standard"}) == 0
    waits = "syshax_router_queue_wait_seconds_count"
    assert metric(router, waits, **{"class": "standard"}) == 2
    assert metric(router, waits, **{"class": "batch"}) == 1
    assert len(completions(gpu)) == 1
