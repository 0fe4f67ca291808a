"""The gateway's group commits and its cache of credentials, against what an attacker with
one machine token tried: a report that fails its batch fails alone; a router's report for
another router gets the control plane's 403, even batched with that router's own; a token
moved to another node is refused for its old one. On SQLite and on PostgreSQL (run with
``DATABASE_URL`` naming one), whose statements differ."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from django.utils import timezone

from controlplane.access.authentication import credentials_fingerprint
from controlplane.access.models import MachineCredential
from controlplane.gateway.fleet import Credentials, GroupCommit, Machine
from controlplane.inventory.api.serializers import HeartbeatInSerializer
from controlplane.inventory.models import Heartbeat
from controlplane.routers.api.serializers import StatsSerializer
from controlplane.routers.models import RouterInstance
from controlplane.routers.services import record_stats_batch
from tests.controlplane.gateway.test_gateway import (
    _agent,
    _beat,
    _next_snapshot,
    _node,
    _router,
    _stats,
)
from tests.support.gateway import Running, serving_gateway

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gateway(live_server: Any) -> Iterator[Running]:
    with serving_gateway(live_server.url, credential_ttl=0.0) as running:
        yield running


@pytest.fixture
def caching_gateway(live_server: Any) -> Iterator[Running]:
    """One that keeps a credential's lookup for five minutes, unless the snapshot's
    fingerprint of the credentials changes."""
    with serving_gateway(live_server.url, credential_ttl=300.0) as running:
        yield running


def _in_loop(gateway: Running, work: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run_coroutine_threadsafe(work(), gateway.loop).result(30)


def _valid(serializer: Any, data: dict[str, Any]) -> dict[str, Any]:
    validator = serializer(data=data)
    assert validator.is_valid(), validator.errors
    return dict(validator.validated_data)


# --- one bad report fails alone --------------------------------------------------------------


def test_one_heartbeat_the_database_refuses_fails_alone_and_its_batch_is_written(
    gateway: Running,
) -> None:
    """A heartbeat a reader let through by mistake (a card named by a lone surrogate, which
    neither SQLite's driver nor PostgreSQL's jsonb takes) fails only itself: the others in
    its batch are written and answered, and it goes to the control plane."""
    nodes = [_node("online") for _ in range(4)]
    bad = _valid(HeartbeatInSerializer, _beat())
    bad["accelerators"] = [{**bad["accelerators"][0], "uuid": "GPU-\ud800"}]
    reports = [(n.pk, _valid(HeartbeatInSerializer, _beat())) for n in nodes]
    reports[1] = (nodes[1].pk, bad)
    batcher = gateway.gateway.batcher

    async def together() -> list[Any]:  # submitted in one turn of the loop: one batch
        return await asyncio.gather(*(batcher.submit(pk, (pk, p)) for pk, p in reports))

    answers = _in_loop(gateway, together)
    assert answers == [("online", ""), None, ("online", ""), ("online", "")]
    assert [Heartbeat.objects.filter(node=n).count() for n in nodes] == [1, 0, 1, 1]
    assert batcher.batches == 1 and batcher.written == 3 and batcher.failed == 1


def test_one_stats_report_the_database_refuses_fails_alone(gateway: Running) -> None:
    """A policy version past any integer column, batched with three good reports."""
    routers = [_router(f"r-batch-{i}")[0] for i in range(4)]
    reports = [(r.pk, r.credential_id, _valid(StatsSerializer, _stats())) for r in routers]
    reports[2][2]["policy_version"] = 2**63
    commit = gateway.gateway.stats

    async def together() -> list[Any]:
        return await asyncio.gather(*(commit.submit((r, c), (r, c, s)) for r, c, s in reports))

    assert _in_loop(gateway, together) == [True, True, None, True]
    assert [r.samples.count() for r in routers] == [1, 1, 0, 1]
    assert commit.written == 3 and commit.failed == 1


def test_a_heartbeat_naming_a_card_by_a_lone_surrogate_is_the_control_planes_400(
    gateway: Running,
) -> None:
    """The reader refuses it, so it never reaches a batch (it had failed every batch it was
    in: the attacker's one agent token took every agent's heartbeats to the control
    plane)."""
    node = _node("online")
    client = _agent(node)
    url = f"{gateway.url}/api/v1/nodes/{node.pk}/heartbeat"
    body = b'{"accelerators": [{"uuid": "GPU-\\ud800", "utilization_percent": 1}]}'
    refused = client.post(url, content=body, headers={"Content-Type": "application/json"})
    assert refused.status_code == 400 and "surrogate" in refused.text
    gw = gateway.gateway
    assert gw.batcher.batches == 0 and gw.proxied == 1
    assert client.post(url, json=_beat()).status_code == 200
    assert gw.batcher.written == 1 and gw.proxied == 1


def test_stats_with_an_outcome_named_by_a_lone_surrogate_are_the_control_planes_400(
    gateway: Running,
) -> None:
    """No serializer field checks an outcome's name; the control plane's parser refuses
    the character (PostgreSQL's jsonb cannot hold it), and so does the gateway's reader."""
    router, client = _router("r-surrogate")
    body = b'{"outcomes": {"ok": 1, "\\ud800": 2}}'
    answer = client.post(
        f"{gateway.url}/api/v1/routers/{router.pk}/stats",
        content=body,
        headers={"Content-Type": "application/json"},
    )
    assert answer.status_code == 400 and "surrogate" in answer.text
    assert gateway.gateway.stats.batches == 0 and router.samples.count() == 0


# --- an answer is its own credential's ---------------------------------------------------------


def test_a_router_reporting_for_another_in_its_batch_gets_the_control_planes_403(
    gateway: Running,
) -> None:
    """r1's token posts r2's stats, and r2 its own, into one batch: r2's report is stored
    and accepted; r1's gets the control plane's 403 and leaves no sample."""
    (blocker, blocking), (r1, c1), (r2, c2) = (_router(n) for n in ("r-0", "r-1", "r-2"))
    commit = gateway.gateway.stats
    write, entered, gate = commit.write, threading.Event(), threading.Event()

    async def held(reports: list[Any]) -> Any:
        if any(router == blocker.pk for router, _, _ in reports):
            entered.set()
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 20)
        return await write(reports)

    commit.write = held
    url = f"{gateway.url}/api/v1/routers/{{}}/stats"

    def queued(n: int) -> None:
        deadline = time.monotonic() + 20
        while len(commit._pending) < n:
            assert time.monotonic() < deadline, "the report did not reach the batch"
            time.sleep(0.01)

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(blocking.post, url.format(blocker.pk), json=_stats())
        assert entered.wait(20)
        foreign = pool.submit(c1.post, url.format(r2.pk), json=_stats(request_rate=666.0))
        queued(1)
        own = pool.submit(c2.post, url.format(r2.pk), json=_stats(request_rate=7.0))
        queued(2)
        gate.set()
        answers = first.result(), foreign.result(), own.result()
    assert [a.status_code for a in answers] == [200, 403, 200]
    assert "its own stats" in answers[1].json()["error"]["message"]
    assert commit.batches == 2 and commit.written == 2
    r2.refresh_from_db()
    assert r2.request_rate == 7.0
    assert list(r2.samples.values_list("request_rate", flat=True)) == [7.0]
    assert r1.samples.count() == 0


def test_a_batch_stores_stats_only_from_a_routers_own_active_credential() -> None:
    """Whatever the order in the batch, on either database: a report by another credential
    is neither stored nor the answer to one, and a revoked credential's is not stored."""
    (r1, _), (r2, _), (r3, _) = (_router(n) for n in ("r-a", "r-b", "r-c"))
    r3.credential.revoke()
    reports = [
        (r2.pk, r1.credential_id, _valid(StatsSerializer, _stats(request_rate=666.0))),
        (r2.pk, r2.credential_id, _valid(StatsSerializer, _stats(request_rate=2.0))),
        (r1.pk, r2.credential_id, _valid(StatsSerializer, _stats(request_rate=666.0))),
        (r3.pk, r3.credential_id, _valid(StatsSerializer, _stats(request_rate=3.0))),
    ]
    for batch in (reports, reports[::-1]):
        assert record_stats_batch(batch) == {(r2.pk, r2.credential_id)}
    assert list(r2.samples.values_list("request_rate", flat=True)) == [2.0, 2.0]
    assert r1.samples.count() == 0 and r3.samples.count() == 0
    assert RouterInstance.objects.get(pk=r2.pk).request_rate == 2.0


# --- the credentials' cache --------------------------------------------------------------------


def test_a_token_moved_to_another_node_is_refused_for_its_old_one(
    caching_gateway: Running, live_server: Any
) -> None:
    """By the admin (a save) and by a queryset's update: each is seen by the next snapshot,
    which drops the gateway's kept lookups."""
    a, b = _node("online"), _node("online")
    client = _agent(a)
    credential = MachineCredential.objects.get(node=a)
    gw = caching_gateway.gateway

    def beat(node: Any, via: str) -> int:
        return client.post(f"{via}/api/v1/nodes/{node.pk}/heartbeat", json=_beat()).status_code

    assert beat(a, caching_gateway.url) == 200 and gw.proxied == 0  # its lookup kept
    credential.node = b
    credential.save()
    _next_snapshot(caching_gateway)
    refused = beat(a, live_server.url)
    assert refused in (403, 404)
    assert beat(a, caching_gateway.url) == refused
    assert beat(b, caching_gateway.url) == 200
    MachineCredential.objects.filter(pk=credential.pk).update(node=a)
    _next_snapshot(caching_gateway)
    assert beat(b, caching_gateway.url) == refused
    assert beat(a, caching_gateway.url) == 200


def test_the_fingerprint_follows_every_change_of_a_credential_but_its_use() -> None:
    a, b = _node("online"), _node("online")
    credential = MachineCredential.issue("agent", "moving", node=a)[0]
    seen = [credentials_fingerprint()]

    def changed() -> bool:
        seen.append(credentials_fingerprint())
        return seen[-1] != seen[-2]

    MachineCredential.objects.filter(pk=credential.pk).update(last_used_at=timezone.now())
    credential.last_used_at = timezone.now()
    credential.save(update_fields=["last_used_at"])
    assert not changed(), "a use is no change: it would empty the cache at every lookup"
    credential.node = b
    credential.save()
    assert changed()
    MachineCredential.objects.filter(pk=credential.pk).update(node=a)
    assert changed()
    MachineCredential.objects.filter(pk=credential.pk).update(kind="router", node=None)
    assert changed()
    credential.refresh_from_db()
    credential.kind, credential.node = "agent", a
    credential.save(update_fields=["kind", "node"])
    assert changed()
    credential.revoke()
    assert changed()
    MachineCredential.objects.filter(pk=credential.pk).update(revoked_at=None)
    assert changed()
    credential.delete()
    assert changed()


def test_a_lookup_read_before_the_cache_was_dropped_is_not_kept() -> None:
    """The credential changed while its lookup was under way: the lookup answers its
    request, but the next one reads the credential again."""

    class Held:
        def __init__(self) -> None:
            self.reading, self.gate = asyncio.Event(), asyncio.Event()

        async def read(self, fn: Callable[..., Any], *args: Any) -> Any:
            self.reading.set()
            await self.gate.wait()
            return fn(*args)

    async def scenario() -> int:
        db = Held()
        credentials = Credentials(db, ttl=300.0)  # type: ignore[arg-type]
        credentials.fetch = lambda tokens: {t: Machine(1, "agent", 7) for t in tokens}
        runner = asyncio.create_task(credentials.run())
        try:
            lookup = asyncio.create_task(credentials.get("sxa_token"))
            await db.reading.wait()
            credentials.forget()  # a snapshot saw the change
            db.gate.set()
            assert await lookup == Machine(1, "agent", 7)
            await credentials.get("sxa_token")
            return credentials.calls
        finally:
            runner.cancel()

    assert asyncio.run(scenario()) == 2


# --- the group commit's answers ---------------------------------------------------------------


def _answers(
    entries: list[tuple[int, str]], fail: Callable[[list[str]], BaseException | None]
) -> tuple[list[Any], int, GroupCommit[int, str]]:
    """Each entry's answer from a group commit whose write answers ``{key: report}`` for
    its reports, or raises what ``fail`` makes of them; and the number of writes."""
    writes = 0

    async def write(reports: list[tuple[int, str]]) -> tuple[dict[Any, Any], list[float]]:
        nonlocal writes
        writes += 1
        if (exc := fail([r for _, r in reports])) is not None:
            raise exc
        return dict(reports), []

    async def scenario() -> tuple[list[Any], GroupCommit[int, str]]:
        commit: GroupCommit[int, str] = GroupCommit("test", write)
        runner = asyncio.create_task(commit.run())
        try:
            answers = await asyncio.gather(*(commit.submit(k, (k, r)) for k, r in entries))
            return list(answers), commit
        finally:
            runner.cancel()

    answers, commit = asyncio.run(scenario())
    return answers, writes, commit


def _refusing(reports: list[str]) -> BaseException | None:
    return ValueError("a report the database refuses") if "bad" in reports else None


def test_a_failed_write_is_retried_without_its_bad_reports() -> None:
    entries = [(k, "bad" if k in (3, 9) else f"ok-{k}") for k in range(16)]
    answers, writes, commit = _answers(entries, _refusing)
    assert answers == [None if k in (3, 9) else f"ok-{k}" for k in range(16)]
    assert commit.failed == 2 and commit.written == 14 and writes == 1 + commit.retries


def test_a_report_is_answered_by_the_write_that_held_it() -> None:
    """Two reports of one key (a node's two heartbeats), one bad: the good one's write
    stored the key, and still the bad one is not answered from it."""
    answers, _, _ = _answers([(1, "bad"), (1, "ok")], _refusing)
    assert answers == [None, "ok"]


def test_a_database_that_is_down_is_not_asked_again_for_each_part() -> None:
    def down(reports: list[str]) -> BaseException:
        return psycopg.OperationalError("the server closed the connection")

    answers, writes, commit = _answers([(k, "ok") for k in range(40)], down)
    assert answers == [None] * 40 and writes == 1 and commit.failed == 40


def test_a_batch_of_bad_reports_stops_after_its_retries() -> None:
    answers, writes, _ = _answers([(k, "bad") for k in range(500)], _refusing)
    assert answers == [None] * 500 and writes == 1 + GroupCommit.MAX_RETRIES
