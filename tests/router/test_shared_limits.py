"""Shared limits (docs/router.md, "Shared limits"; decision record 64): two routers' tenant
tables on one Redis hold a tenant to one RPM and one TPM bucket; Redis killed, paused, slow or
flushed never fails or delays an admission past the bound, the router holds the limits
locally at 1/routers-seen, says so in its metrics and one log line, and shares them again
once Redis answers. In-process against real Redis: the suite's for the shared buckets, one
of the test's own for everything that breaks it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
from redis_server import OwnRedis, suite_redis_url

from common.tenants import TenantRecord
from router.client.errors import RouterError
from router.client.shared_limits import SharedLimits
from router.client.tenants import Admission, Tenants
from router.metrics import RouterMetrics, SharedLimitsMetrics

# The bound an admission may wait for Redis here: the 5 ms default leaves no room for a
# 2-core test machine's scheduling; the assertions allow for the loop's own delays too.
BOUND = 0.02
SLACK = 0.15


class Router:
    """One router's side of the limits: its tenant table, its shared limits, its metrics."""

    def __init__(self, url: str, prefix: str, *records: TenantRecord) -> None:
        self.metrics = RouterMetrics()
        self.shared = SharedLimits(
            url, SharedLimitsMetrics(self.metrics.registry), BOUND, prefix, heartbeat_seconds=0.1
        )
        self.tenants = Tenants("router-key-text", (), self.metrics, shared=self.shared)
        self.tenants.set_records(records)

    def sample(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name) or 0.0

    async def admit(self, tenant: TenantRecord, tokens: int = 1) -> Admission | RouterError:
        try:
            return await self.tenants.admit_shared(tenant, "m", tokens)
        except RouterError as err:
            return err

    async def settled(self) -> None:
        """Wait for the TPM settlements sent without waiting."""
        await asyncio.gather(*self.shared._pending)


async def start_router(url: str, prefix: str, *records: TenantRecord) -> Router:
    router = Router(url, prefix, *records)
    await router.shared.start()
    return router


def tenant(**limits: int) -> TenantRecord:
    return TenantRecord(f"t-{uuid.uuid4().hex[:10]}", **limits)  # type: ignore[arg-type]


def codes(results: list[Admission | RouterError]) -> list[str]:
    return [r.code or "" if isinstance(r, RouterError) else "ok" for r in results]


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


@pytest.fixture
def prefix() -> str:
    return f"syshax:limits:test:{uuid.uuid4().hex}"


@pytest.fixture
def own_redis() -> Iterator[OwnRedis]:
    server = OwnRedis()
    yield server
    server.stop()


# -- shared -----------------------------------------------------------------------------------


def test_two_routers_share_one_rpm_bucket_burst_then_refill(prefix: str) -> None:
    url = suite_redis_url()
    acme = tenant(rpm_limit=120)  # 2 a second

    async def main() -> None:
        a, b = await start_router(url, prefix, acme), await start_router(url, prefix, acme)
        results = [await (a if i % 2 else b).admit(acme) for i in range(130)]
        assert codes(results) == ["ok"] * 120 + ["rpm_limit_exceeded"] * 10
        refusal = results[-1]
        assert isinstance(refusal, RouterError) and refusal.retry_after is not None
        assert 0 < refusal.retry_after <= 0.5  # one request's room: 0.5 s at most
        await asyncio.sleep(1.0)  # two requests' room, on Redis's clock
        later = [await a.admit(acme), await b.admit(acme), await a.admit(acme)]
        assert codes(later) == ["ok", "ok", "rpm_limit_exceeded"]
        assert a.sample("syshax_router_limits_local") == 0
        for router in (a, b):
            await router.shared.close()

    run(main)


def test_tpm_is_charged_and_settled_across_routers(prefix: str) -> None:
    url = suite_redis_url()
    acme = tenant(tpm_limit=1200)

    async def main() -> None:
        a, b = await start_router(url, prefix, acme), await start_router(url, prefix, acme)
        first = await a.admit(acme, 800)
        assert isinstance(first, Admission) and first.shared and first.charged == 800
        refused = await b.admit(acme, 800)
        assert isinstance(refused, RouterError) and refused.code == "tpm_limit_exceeded"
        assert refused.retry_after == pytest.approx(20.0, abs=0.5)  # 400 missing at 20 a second
        # The first used 100 of its 800: router a gives 700 back, router b can take 800.
        a.tenants.settle(first, 60, 40, ok=True)
        await a.settled()
        second = await b.admit(acme, 800)
        assert isinstance(second, Admission)
        # An under-estimate is owed on the shared bucket: 1100 used, it goes below zero.
        b.tenants.settle(second, 1000, 100, ok=True)
        await b.settled()
        assert codes([await a.admit(acme, 1)]) == ["tpm_limit_exceeded"]
        # A refused request after admission (shed) gives its whole charge back.
        c = tenant(tpm_limit=600)
        a.tenants.set_records([acme, c])
        b.tenants.set_records([acme, c])
        shed = await a.admit(c, 600)
        assert isinstance(shed, Admission)
        a.tenants.reject(c, "shed", shed)
        await a.settled()
        assert codes([await b.admit(c, 600)]) == ["ok"]
        # Each router reports only what it settled: the control plane adds them up once.
        assert a.tenants.take_usage()[acme.name]["requests"] == 1
        assert b.tenants.take_usage()[acme.name]["requests"] == 1
        for router in (a, b):
            await router.shared.close()

    run(main)


def test_without_a_redis_url_the_limits_are_local_as_before() -> None:
    tenants = Tenants("router-key-text", (), RouterMetrics())
    acme = tenant(rpm_limit=2)
    tenants.set_records([acme])

    async def main() -> None:
        results = []
        for _ in range(3):
            try:
                results.append(await tenants.admit_shared(acme, "m", 1))
            except RouterError as err:
                results.append(err)
        assert codes(results) == ["ok", "ok", "rpm_limit_exceeded"]
        assert all(r.limits is not None for r in results if isinstance(r, Admission))

    run(main)


# -- Redis breaks -----------------------------------------------------------------------------


def test_redis_killed_falls_back_to_divided_local_limits_and_converges(
    own_redis: OwnRedis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    acme = tenant(rpm_limit=60)

    async def main() -> None:
        a, b = (
            await start_router(own_redis.url, prefix, acme),
            await start_router(own_redis.url, prefix, acme),
        )
        await a.shared.beat()
        await b.shared.beat()
        await a.shared.beat()
        assert a.shared.routers == 2
        assert codes([await a.admit(acme) for _ in range(10)]) == ["ok"] * 10
        own_redis.kill()
        with caplog.at_level(logging.WARNING, logger="syshax.router"):
            started = time.perf_counter()
            results = [await a.admit(acme) for _ in range(21)]
            elapsed = time.perf_counter() - started
            await a.shared.beat()  # the heartbeat fails too: still one transition
        # Served on a local bucket of 60 / 2 routers, less the 10 it let in while shared.
        assert codes(results) == ["ok"] * 20 + ["rpm_limit_exceeded"]
        assert a.sample("syshax_router_limits_local_admissions_total") == 21
        assert elapsed < BOUND + SLACK
        assert a.sample("syshax_router_limits_local") == 1
        assert a.sample("syshax_router_limits_fallbacks_total") == 1
        lines = [r.getMessage() for r in caplog.records if "shared limits" in r.getMessage()]
        assert len(lines) == 1 and "locally at 1/2" in lines[0], lines
        # Redis back (empty): the next heartbeat within the bound shares the limits again.
        own_redis.start()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="syshax.router"):
            for _ in range(50):
                await a.shared.beat()
                if not a.shared.local:
                    break
                await asyncio.sleep(0.05)
        assert not a.shared.local and a.sample("syshax_router_limits_local") == 0
        assert any("answers again" in r.getMessage() for r in caplog.records)
        assert codes([await a.admit(acme)]) == ["ok"]
        assert own_redis.client().exists(f"{prefix}:{{{acme.name}}}:rpm")
        for router in (a, b):
            await router.shared.close()

    run(main)


def test_a_flushed_redis_recreates_its_keys_and_fails_nothing(
    own_redis: OwnRedis, prefix: str
) -> None:
    acme = tenant(rpm_limit=5, tpm_limit=1000)

    async def main() -> None:
        a = await start_router(own_redis.url, prefix, acme)
        assert codes([await a.admit(acme, 10) for _ in range(6)])[-1] == "rpm_limit_exceeded"
        own_redis.client().flushall()
        own_redis.client().script_flush()  # as a restarted Redis: the scripts gone too
        results = [await a.admit(acme, 10) for _ in range(6)]
        assert codes(results) == ["ok"] * 5 + ["rpm_limit_exceeded"]
        assert a.sample("syshax_router_limits_local") == 0
        assert a.sample("syshax_router_limits_fallbacks_total") == 0
        keys = own_redis.client().keys(f"{prefix}:*")
        assert {k.decode().rsplit(":", 1)[1] for k in keys} == {"rpm", "tpm"}
        # Keys expire once their bucket would be full again: no key outlives a minute.
        assert 0 < own_redis.client().pttl(f"{prefix}:{{{acme.name}}}:rpm") <= 61_000
        await a.shared.close()

    run(main)


def test_a_slow_redis_delays_no_admission_past_the_bound(own_redis: OwnRedis, prefix: str) -> None:
    acme = tenant(rpm_limit=600)

    async def main() -> None:
        a = await start_router(own_redis.url, prefix, acme)
        assert codes([await a.admit(acme)]) == ["ok"]
        # Redis busy for half a second with another client's command.
        sleeper = threading.Thread(
            target=own_redis.client().execute_command, args=("DEBUG", "SLEEP", "0.5")
        )
        sleeper.start()
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        first = await a.admit(acme)
        waited = time.perf_counter() - started
        assert isinstance(first, Admission) and not first.shared
        assert waited < BOUND + SLACK
        started = time.perf_counter()
        assert codes([await a.admit(acme) for _ in range(20)]) == ["ok"] * 20
        assert time.perf_counter() - started < SLACK  # local now: Redis not asked
        assert a.sample("syshax_router_limits_local") == 1
        await asyncio.to_thread(sleeper.join)
        for _ in range(50):
            await a.shared.beat()
            if not a.shared.local:
                break
        assert not a.shared.local
        again = await a.admit(acme)
        assert isinstance(again, Admission) and again.shared
        await a.shared.close()

    run(main)


def test_a_paused_redis_delays_no_admission_past_the_bound(
    own_redis: OwnRedis, prefix: str
) -> None:
    acme = tenant(rpm_limit=600, tpm_limit=100_000)

    async def main() -> None:
        a = await start_router(own_redis.url, prefix, acme)
        assert codes([await a.admit(acme, 100)]) == ["ok"]
        own_redis.pause()
        try:
            started = time.perf_counter()
            results = [await a.admit(acme, 100) for _ in range(5)]
            waited = time.perf_counter() - started
            await a.shared.beat()  # times out in the background's bound, stays local
        finally:
            own_redis.resume()
        assert codes(results) == ["ok"] * 5
        assert waited < BOUND + SLACK
        assert a.sample("syshax_router_limits_fallbacks_total") == 1
        for _ in range(50):
            await a.shared.beat()
            if not a.shared.local:
                break
        assert a.sample("syshax_router_limits_local") == 0
        await a.shared.close()

    run(main)
