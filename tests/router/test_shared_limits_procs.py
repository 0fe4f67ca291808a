"""Shared limits across router processes (docs/router.md, "Shared limits"): two standalone
routers started with ``--shared-limits-url`` hold a tenant to one RPM bucket, burst then
refill, exactly; a ``--workers 2`` router's workers likewise; a router whose Redis is killed
keeps serving on its local share and says so in ``/metrics``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from recording_engine import RecordingEngine
from redis_server import OwnRedis, suite_redis_url
from router_procs import MODEL, Proc, metric, wait_for

from common.tenants import hash_key

pytestmark = pytest.mark.process  # routers and a stand-in engine

KEY = "sk-shx-shared-limits"
# A bound that a busy 2-core test machine keeps to.
TIMEOUT = "0.05"


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    stub = RecordingEngine()
    yield stub
    stub.close()


@pytest.fixture
def own_redis() -> Iterator[OwnRedis]:
    server = OwnRedis()
    yield server
    server.stop()


def tenants_file(workdir: Path, rpm: int) -> tuple[Path, str]:
    """A tenants file of one tenant, named afresh so the suite's Redis holds no bucket of it."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    path = workdir / f"{name}.json"
    path.write_text(
        json.dumps({"tenants": [{"name": name, "keys": [hash_key(KEY)], "rpm_limit": rpm}]})
    )
    return path, name


def status(router: Proc) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(
        router.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
    ).status_code


def until_admitted(router: Proc) -> float:
    """When the router next lets the tenant in (asked every 50 ms)."""
    deadline = time.monotonic() + 10
    while status(router) != 200:
        assert time.monotonic() < deadline, "never let in again"
        time.sleep(0.05)
    return time.monotonic()


def shared_router(
    router_factory: Callable[..., Proc],
    engine: RecordingEngine,
    tenants: Path,
    url: str,
    *extra: str,
) -> Proc:
    return router_factory(
        engine.url,
        None,
        "--tenants-file",
        str(tenants),
        "--shared-limits-url",
        url,
        "--shared-limits-timeout",
        TIMEOUT,
        *extra,
    )


def test_two_router_processes_hold_a_tenant_to_one_rpm_burst_then_refill(
    tmp_path: Path, engine: RecordingEngine, router_factory: Callable[..., Proc]
) -> None:
    url = suite_redis_url()
    # Refills one request every 5 s: the burst's 18 requests end long before the first
    # refill even on a busy machine.
    tenants, _ = tenants_file(tmp_path, rpm=12)
    a = shared_router(router_factory, engine, tenants, url)
    b = shared_router(router_factory, engine, tenants, url)
    answers = [status(a if i % 2 else b) for i in range(18)]
    assert answers == [200] * 12 + [429] * 6
    # Then one request every 5 s, whichever router it reaches, and never two at once: never
    # early, and late only by the 50 ms polling and a busy machine's answer times.
    admitted = []
    for i in range(2):
        admitted.append(until_admitted(a if i else b))
        assert [status(a), status(b)] == [429, 429]
    assert 4.9 <= admitted[1] - admitted[0] <= 6.5
    for router in (a, b):
        assert metric(router, "syshax_router_limits_local") == 0
        assert metric(router, "syshax_router_limits_fallbacks_total") == 0
    assert wait_for(lambda: metric(a, "syshax_router_limits_routers") == 2)


def test_the_workers_of_one_router_share_the_bucket(
    tmp_path: Path, engine: RecordingEngine, router_factory: Callable[..., Proc]
) -> None:
    url = suite_redis_url()
    tenants, _ = tenants_file(tmp_path, rpm=12)  # a refill every 5 s: none in the run
    router = shared_router(router_factory, engine, tenants, url, "--workers", "2")
    # Fresh connections, spread over both workers by the kernel.
    answers = [status(router) for _ in range(18)]
    assert answers == [200] * 12 + [429] * 6


def test_a_router_that_loses_redis_serves_on_its_share_and_says_so(
    tmp_path: Path,
    engine: RecordingEngine,
    router_factory: Callable[..., Proc],
    own_redis: OwnRedis,
) -> None:
    tenants, _ = tenants_file(tmp_path, rpm=20)
    a = shared_router(router_factory, engine, tenants, own_redis.url)
    b = shared_router(router_factory, engine, tenants, own_redis.url)
    assert wait_for(lambda: metric(a, "syshax_router_limits_routers") == 2)
    assert status(a) == 200
    own_redis.kill()
    answers = [status(a) for _ in range(12)]
    # 20 / 2 routers, its local share, less the one request it let in while shared.
    assert answers == [200] * 9 + [429] * 3
    assert metric(a, "syshax_router_limits_local") == 1
    assert metric(a, "syshax_router_limits_fallbacks_total") == 1
    own_redis.start()
    assert wait_for(lambda: metric(a, "syshax_router_limits_local") == 0, timeout=10)
    assert wait_for(lambda: metric(b, "syshax_router_limits_local") == 0, timeout=10)
    assert status(b) == 200  # a fresh shared bucket: the flushed Redis forgot the old one
