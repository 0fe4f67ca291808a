"""The machine gateway in front of the real control plane (pytest-django's live server): what
it answers itself is what the control plane would have answered and stored, and everything
else reaches the control plane unchanged."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from common.supervisor import free_port
from controlplane.access.models import MachineCredential
from controlplane.core.models import AuditEntry
from controlplane.deployments.models import AgentCommand
from controlplane.gateway import payloads
from controlplane.gateway.server import SWITCH_INTERVAL
from controlplane.inventory.api.serializers import HeartbeatInSerializer
from controlplane.inventory.models import Accelerator, Heartbeat, Node
from controlplane.inventory.services import record_steady_heartbeats
from controlplane.policy.models import SchedulingPolicy
from controlplane.routers.api.serializers import StatsSerializer
from controlplane.routers.models import RouterInstance
from controlplane.routers.services import record_stats_batch, register_router
from syshax.commands.gateway import add_arguments
from testbed.factories import build_node
from tests.controlplane.inventory.test_inventory import KUNPENG
from tests.support.gateway import Running, serving_gateway

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gateway(live_server: Any) -> Iterator[Running]:
    """A gateway on its own event loop thread, in front of the live server."""
    with serving_gateway(live_server.url, credential_ttl=0.0) as running:
        yield running


def _fields(response: httpx.Response) -> dict[str, str]:
    """An answer's fields, less those of the moment and of the connection."""
    skip = {"date", "connection", "keep-alive", "server"}
    return {k: v for k, v in response.headers.items() if k not in skip}


def _next_snapshot(gateway: Running) -> None:
    """Wait until the gateway has read the database as it is now."""
    now = time.monotonic()
    deadline = now + 10
    while (snapshot := gateway.gateway.watcher.current()) is None or snapshot.taken_at <= now:
        assert time.monotonic() < deadline, "no new snapshot"
        time.sleep(0.02)


def _agent(node: Node, name: str = "agent") -> httpx.Client:
    token = MachineCredential.issue("agent", f"{name}-{node.pk}", node=node)[1]
    return httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _beat(temperature: float = 61.0) -> dict[str, Any]:
    return {
        "cpu_percent": 12.5,
        "memory_used_bytes": 3 * 2**30,
        "memory_total_bytes": 64 * 2**30,
        "inventory_hash": "abc",
        "accelerators": [
            {
                "uuid": "GPU-0",
                "utilization_percent": 40,
                "memory_used_bytes": 2**30,
                "temperature_c": temperature,
            },
        ],
    }


def _node(status: str) -> Node:
    node = build_node(status=status)
    Accelerator.objects.filter(node=node).update(uuid="GPU-0")
    return node


def test_a_steady_heartbeat_is_answered_and_stored_as_the_control_plane_would(
    gateway: Running,
) -> None:
    node, twin = _node("online"), _node("online")
    via_gateway = _agent(node).post(f"{gateway.url}/api/v1/nodes/{node.pk}/heartbeat", json=_beat())
    direct = _agent(twin).post(
        f"{gateway.gateway.upstream}/api/v1/nodes/{twin.pk}/heartbeat", json=_beat()
    )
    assert via_gateway.status_code == direct.status_code == 200
    assert via_gateway.json() == direct.json()
    assert gateway.gateway.batcher.written == 1 and gateway.gateway.proxied == 0
    fields = ["cpu_percent", "memory_used_bytes", "memory_total_bytes", "accelerators"]
    ours = Heartbeat.objects.filter(node=node).values(*fields).get()
    theirs = Heartbeat.objects.filter(node=twin).values(*fields).get()
    assert ours == theirs
    card = ["utilization_percent", "memory_used_bytes", "temperature_c"]
    assert (
        Accelerator.objects.filter(node=node).values(*card).get()
        == Accelerator.objects.filter(node=twin).values(*card).get()
        == {"utilization_percent": 40.0, "memory_used_bytes": 2**30, "temperature_c": 61.0}
    )
    node.refresh_from_db()
    assert node.status == "online" and node.last_heartbeat_at is not None
    report = gateway.gateway.report()  # what its log says every 30 s
    assert "1 heartbeats in 1 batches" in report and "(p50 / p99 of the last 1)" in report
    assert "of the last 0)" in gateway.gateway.report()  # the times start again


def test_a_returning_node_and_a_bad_payload_go_to_the_control_plane(gateway: Running) -> None:
    offline = _node("offline")
    client = _agent(offline)
    answer = client.post(f"{gateway.url}/api/v1/nodes/{offline.pk}/heartbeat", json=_beat())
    assert answer.status_code == 200 and answer.json()["status"] == "online"
    assert AuditEntry.objects.filter(action="node.online", object_id=str(offline.pk)).exists()
    assert Heartbeat.objects.filter(node=offline).count() == 1  # stored once, by Django
    bad = client.post(
        f"{gateway.url}/api/v1/nodes/{offline.pk}/heartbeat", json={**_beat(), "cpu_percent": 150}
    )
    assert bad.status_code == 400 and "cpu_percent" in bad.json()["error"]["fields"]
    other = _node("online")
    foreign = client.post(f"{gateway.url}/api/v1/nodes/{other.pk}/heartbeat", json=_beat())
    assert foreign.status_code in (403, 404)
    assert not Heartbeat.objects.filter(node=other).exists()
    assert gateway.gateway.proxied == 3


def test_a_revoked_or_unknown_token_gets_the_control_planes_refusal(gateway: Running) -> None:
    """Lookups are kept (an hour here), but a revocation drops them at the next snapshot."""
    gateway.gateway.credentials.ttl = 3600
    node = _node("online")
    client = _agent(node)
    _next_snapshot(gateway)  # one that knows the new credential: it forgets nothing after
    url = f"{gateway.url}/api/v1/nodes/{node.pk}/heartbeat"
    assert client.post(url, json=_beat()).status_code == 200
    lookups = gateway.gateway.credentials.calls
    assert client.post(url, json=_beat()).status_code == 200
    assert gateway.gateway.credentials.calls == lookups, "the second used the kept lookup"
    credential = MachineCredential.objects.get(node=node)
    credential.revoked_at = credential.created_at
    credential.save()
    _next_snapshot(gateway)
    refused = client.post(url, json=_beat())
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    stranger = httpx.post(url, json=_beat(), headers={"Authorization": "Bearer sxa_nope"})
    assert stranger.status_code == 401 and "error" in stranger.json()
    assert Heartbeat.objects.filter(node=node).count() == 2


def test_router_polls_are_answered_304_from_the_snapshot_and_changes_reach_them(
    gateway: Running,
) -> None:
    SchedulingPolicy.objects.get_or_create(name="default")
    _next_snapshot(gateway)
    token = MachineCredential.issue("router", "router-a")[1]
    router = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30)
    for path in ("routing/policies/default", "routing/deployments"):
        first = router.get(f"{gateway.url}/api/v1/{path}")
        assert first.status_code == 200, first.text
        etag = first.headers["ETag"]
        proxied = gateway.gateway.proxied
        again = router.get(f"{gateway.url}/api/v1/{path}", headers={"If-None-Match": etag})
        assert again.status_code == 304 and again.headers["ETag"] == etag
        # Another router's first poll gets the control plane's answer, kept by the gateway.
        other = httpx.get(f"{gateway.url}/api/v1/{path}", headers=router.headers, timeout=30)
        assert other.status_code == 200 and other.content == first.content
        assert _fields(other) == _fields(first)
        assert gateway.gateway.proxied == proxied, "answered by the gateway"
    policy = SchedulingPolicy.objects.get(name="default")
    old = policy.etag
    SchedulingPolicy.objects.filter(pk=policy.pk).update(version=policy.version + 1)
    # The gateway's 304s lag a change by at most one snapshot (0.1 s here).
    changed_at = time.monotonic()
    while True:
        changed = router.get(
            f"{gateway.url}/api/v1/routing/policies/default", headers={"If-None-Match": old}
        )
        if changed.status_code != 304:
            break
        assert time.monotonic() - changed_at < 2, "the change never reached the gateway"
        time.sleep(0.02)
    assert changed.status_code == 200 and changed.headers["ETag"] != old
    proxied = gateway.gateway.proxied
    kept = router.get(
        f"{gateway.url}/api/v1/routing/policies/default", headers={"If-None-Match": old}
    )
    assert kept.status_code == 200 and kept.json()["version"] == policy.version + 1
    assert kept.content == changed.content and gateway.gateway.proxied == proxied
    # An agent's token never reads routing: the control plane refuses it.
    agent = _agent(_node("online"))
    refused = agent.get(f"{gateway.url}/api/v1/routing/deployments", headers={"If-None-Match": "*"})
    assert refused.status_code == 403


def test_routers_asking_while_an_answer_is_fetched_wait_for_it(gateway: Running) -> None:
    _next_snapshot(gateway)
    snapshot = gateway.gateway.watcher.current()
    assert snapshot is not None
    token = MachineCredential.issue("router", "router-w")[1]
    path = "/api/v1/routing/deployments"
    routing = gateway.gateway.routing
    # A fetch of the control plane's answer is under way (as for the first router to ask).
    fetching = gateway.call(lambda: routing.fetching.setdefault(path, gateway.loop.create_future()))
    proxied = gateway.gateway.proxied
    answers: list[httpx.Response] = []

    def ask() -> None:
        headers = {"Authorization": f"Bearer {token}", "If-None-Match": '"old"'}
        answers.append(httpx.get(f"{gateway.url}{path}", headers=headers, timeout=30))

    askers = [threading.Thread(target=ask) for _ in range(5)]
    for thread in askers:
        thread.start()
    time.sleep(0.5)
    assert answers == [] and gateway.gateway.proxied == proxied, "they wait for it"
    body = b'{"deployments":[]}'
    fields = [("ETag", snapshot.deployments_etag), ("Content-Type", "application/json")]

    def arrive() -> None:
        routing.keep(path, 200, fields, body)
        del routing.fetching[path]
        fetching.set_result(None)

    gateway.call(arrive)
    for thread in askers:
        thread.join(30)
    assert [(a.status_code, a.content) for a in answers] == [(200, body)] * 5
    assert {a.headers["ETag"] for a in answers} == {snapshot.deployments_etag}
    assert gateway.gateway.proxied == proxied
    # An answer that is not a whole JSON 200 with an ETag is never kept.
    json_type = ("Content-Type", "application/json")
    for status, extra in (
        (304, [json_type]),
        (200, [json_type, ("Set-Cookie", "a=b")]),
        (500, [json_type]),
        (200, [("Content-Type", "text/html; charset=utf-8")]),
    ):
        routing.keep("/x", status, [("ETag", '"e"'), *extra], b"")
        assert "/x" not in routing.kept


def test_a_poll_for_another_form_is_the_control_planes_alone(gateway: Running) -> None:
    """The browsable API (a browser's Accept, or ?format=api) is neither served from what was
    kept nor kept: every JSON router still gets JSON."""
    _next_snapshot(gateway)
    token = MachineCredential.issue("router", "router-html")[1]
    url = f"{gateway.url}/api/v1/routing/deployments"
    auth = {"Authorization": f"Bearer {token}"}
    plain = httpx.get(url, headers={**auth, "Accept": "application/json"}, timeout=30)
    assert plain.headers["Content-Type"] == "application/json" and "deployments" in plain.json()
    assert "/api/v1/routing/deployments" in gateway.gateway.routing.kept
    for asked, params in (({"Accept": "text/html, */*"}, {}), ({}, {"format": "api"})):
        proxied = gateway.gateway.proxied
        html = httpx.get(url, headers={**auth, **asked}, params=params, timeout=30)
        assert html.status_code == 200 and html.headers["Content-Type"].startswith("text/html")
        assert gateway.gateway.proxied == proxied + 1, "the control plane answered it"
    proxied = gateway.gateway.proxied
    again = httpx.get(url, headers=auth, timeout=30)
    assert again.content == plain.content and gateway.gateway.proxied == proxied


def test_an_idle_fetch_is_held_by_the_gateway_and_a_queued_command_reaches_it(
    gateway: Running,
) -> None:
    node = _node("online")
    client = _agent(node)
    url = f"{gateway.url}/api/v1/agent/commands"
    empty = client.get(url, params={"session": "s1"})
    assert empty.status_code == 200 and empty.json() == {"commands": []}
    assert gateway.gateway.proxied == 0

    def queue_later() -> None:
        time.sleep(0.5)
        AgentCommand.objects.create(node=node, action="inspect", spec={"what": "x"})

    threading.Thread(target=queue_later).start()
    started = time.monotonic()
    held = client.get(url, params={"session": "s1", "wait": "5"})
    assert held.status_code == 200 and len(held.json()["commands"]) == 1
    assert 0.4 < time.monotonic() - started < 4
    assert gateway.gateway.proxied == 1, "handed out by the control plane"
    # Handed to s1: its next fetch is idle again, a new session gets the command once more.
    assert client.get(url, params={"session": "s1"}).json() == {"commands": []}
    _next_snapshot(gateway)  # one taken after the hand-out
    assert len(client.get(url, params={"session": "s2"}).json()["commands"]) == 1
    bad = client.get(url, params={"session": "no spaces"})
    assert bad.status_code == 400 and "session" in bad.json()["error"]["fields"]


def test_a_command_wakes_only_its_nodes_held_fetch(gateway: Running, settings: Any) -> None:
    settings.AGENT_COMMAND_WAIT_SECONDS = 3.0
    nodes = [_node("online") for _ in range(6)]
    clients = [_agent(node, f"agent-{i}") for i, node in enumerate(nodes)]
    url = f"{gateway.url}/api/v1/agent/commands"
    answers: dict[int, tuple[float, httpx.Response]] = {}

    def fetch(i: int) -> None:
        started = time.monotonic()
        got = clients[i].get(url, params={"session": "s1", "wait": "3"})
        answers[i] = (time.monotonic() - started, got)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(len(nodes))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while gateway.call(gateway.gateway.watcher.holding) < len(nodes):
        assert time.monotonic() < deadline, "the fetches were not all held"
        time.sleep(0.02)
    AgentCommand.objects.create(node=nodes[2], action="inspect", spec={"what": "x"})
    for thread in threads:
        thread.join(30)
    took, woken = answers[2]
    assert woken.status_code == 200 and len(woken.json()["commands"]) == 1 and took < 2.5
    for i in set(range(len(nodes))) - {2}:
        took, idle = answers[i]
        assert idle.json() == {"commands": []} and took >= 2.9, "held to the end of its wait"
    assert gateway.gateway.proxied == 1, "only the woken fetch went to the control plane"
    assert gateway.call(gateway.gateway.watcher.holding) == 0


def test_snapshots_that_change_nothing_for_a_node_leave_its_fetch_asleep(
    gateway: Running,
) -> None:
    node, busy = _node("online"), _node("online")
    AgentCommand.objects.create(node=busy, action="inspect", spec={"what": "x"})
    _next_snapshot(gateway)
    watcher = gateway.gateway.watcher

    async def hold(node_id: int) -> float:
        started = time.monotonic()
        await watcher.hold(node_id, 1.0)
        return time.monotonic() - started

    idle = asyncio.run_coroutine_threadsafe(hold(node.pk), gateway.loop)
    queued = asyncio.run_coroutine_threadsafe(hold(busy.pk), gateway.loop)
    assert queued.result(10) < 0.5, "a node with something queued looks again each snapshot"
    assert idle.result(10) >= 0.95, "ten snapshots (0.1 s apart) passed without waking it"


def test_a_held_fetch_ends_when_its_token_is_revoked(gateway: Running, settings: Any) -> None:
    settings.AGENT_COMMAND_WAIT_SECONDS = 15.0
    node = _node("online")
    token = MachineCredential.issue("agent", f"agent-{node.pk}", node=node)[1]
    url = f"{gateway.url}/api/v1/agent/commands"
    answer: list[httpx.Response] = []
    started = time.monotonic()
    fetch = threading.Thread(
        target=lambda: answer.append(
            httpx.get(
                url,
                params={"session": "s1", "wait": "15"},
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
        )
    )
    fetch.start()
    deadline = time.monotonic() + 10
    while gateway.call(gateway.gateway.watcher.holding) < 1:
        assert time.monotonic() < deadline, "the fetch was not held"
        time.sleep(0.02)
    assert MachineCredential.objects.get(node=node).revoke()
    fetch.join(30)
    assert answer[0].status_code == 200 and answer[0].json() == {"commands": []}
    assert time.monotonic() - started < 5, "answered when the snapshot saw the revocation"


def test_everything_else_reaches_the_control_plane_unchanged(gateway: Running) -> None:
    health = httpx.get(f"{gateway.url}/api/v1/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    anonymous = httpx.get(f"{gateway.url}/api/v1/nodes")
    assert anonymous.status_code == 401
    too_big = httpx.post(
        f"{gateway.url}/api/v1/nodes/1/heartbeat",
        content=b"x" * (2 * 1024 * 1024 + 1),
        headers={"Content-Type": "application/json"},
    )
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"


def test_a_credential_over_its_rate_is_handed_to_the_control_planes_throttle(
    gateway: Running,
) -> None:
    node = _node("online")
    client = _agent(node)
    gateway.gateway.throttle.window = (2, 60)
    url = f"{gateway.url}/api/v1/nodes/{node.pk}/heartbeat"
    for _ in range(3):
        assert client.post(url, json=_beat()).status_code == 200
    assert gateway.gateway.batcher.written == 2
    assert gateway.gateway.proxied == 1, "the third went to the control plane's own throttle"


def test_a_write_on_a_lost_connection_is_handed_on_and_the_next_one_reconnects(
    gateway: Running,
) -> None:
    """The database drops the writer's connection (on PostgreSQL the server ends it; on
    SQLite it is closed under Django): that batch's heartbeat goes to the control plane,
    which answers it, and the next batch opens a new connection."""
    node = _node("online")
    client = _agent(node)
    url = f"{gateway.url}/api/v1/nodes/{node.pk}/heartbeat"
    assert client.post(url, json=_beat()).status_code == 200
    gw = gateway.gateway

    if connection.vendor == "postgresql":  # the gateway's own connection, from its loop
        pid = gateway.call(lambda: gw.statements.backend_pid)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    else:

        def close() -> None:
            connections["default"].connection.close()

        asyncio.run_coroutine_threadsafe(gw.db.write(close), gateway.loop).result(10)
    proxied = gw.proxied
    handed_on = client.post(url, json=_beat())
    assert handed_on.status_code == 200 and gw.proxied == proxied + 1
    assert client.post(url, json=_beat()).status_code == 200
    assert gw.proxied == proxied + 1 and gw.batcher.written == 2, "written by the gateway again"
    assert Heartbeat.objects.filter(node=node).count() == 3


def test_steady_heartbeats_of_many_nodes_are_one_statement_on_postgresql() -> None:
    """On PostgreSQL a batch is one statement, with no transaction around it; elsewhere
    three in one transaction. Only steady nodes are recorded, and a card reported twice in a
    batch keeps its last readings."""
    online, draining, offline = _node("online"), _node("draining"), _node("offline")
    reports = []
    for n, temperature in ((online, 65.0), (draining, 70.0), (offline, 70.0), (online, 71.0)):
        serializer = HeartbeatInSerializer(data=_beat(temperature=temperature))
        assert serializer.is_valid()
        reports.append((n.pk, serializer.validated_data))
    with CaptureQueriesContext(connection) as queries:
        seen = record_steady_heartbeats(reports)
    statements = [q["sql"].split()[0].upper() for q in queries.captured_queries]
    if connection.vendor == "postgresql":
        assert statements == ["WITH"]
    else:
        assert statements.count("UPDATE") == 2 and statements.count("INSERT") == 1
        assert len([s for s in statements if s not in ("BEGIN", "COMMIT", "SAVEPOINT")]) == 3
    assert seen == {online.pk: ("online", ""), draining.pk: ("draining", "")}
    assert Heartbeat.objects.filter(node=offline).count() == 0
    assert [
        h.accelerators[0]["temperature_c"]
        for h in Heartbeat.objects.filter(node=online).order_by("pk")
    ] == [65.0, 71.0]
    offline.refresh_from_db()
    assert offline.status == "offline" and offline.last_heartbeat_at is None
    assert Accelerator.objects.get(node=online).temperature_c == 71.0
    assert Accelerator.objects.get(node=draining).temperature_c == 70.0
    assert Accelerator.objects.get(node=offline).temperature_c != 70.0


# --- the fast readers never accept what the serializers refuse, nor read it differently ------


def _noise(rng: random.Random) -> Any:
    return rng.choice(
        [
            0,
            1,
            -1,
            100,
            101,
            2**63 - 1,
            2**63,
            12.5,
            -0.5,
            1e308,
            float("nan"),
            float("inf"),
            True,
            False,
            None,
            "",
            " x",
            "12",
            "GPU-1",
            "a" * 65,
            "b" * 129,
            [],
            {},
            [1],
            {"a": 1},
        ]
    )


def _payload(rng: random.Random) -> Any:
    fields = ["cpu_percent", "memory_used_bytes", "memory_total_bytes", "inventory_hash"]
    body: dict[str, Any] = {}
    for name in fields:
        if rng.random() < 0.7:
            body[name] = _noise(rng) if rng.random() < 0.3 else _beat()[name]
    if rng.random() < 0.8:
        cards = []
        for i in range(rng.randint(0, 3)):
            card: dict[str, Any] = {"uuid": f"GPU-{i}"}
            for name, good in (
                ("utilization_percent", 50.0),
                ("memory_used_bytes", 5),
                ("temperature_c", 60.5),
                ("uuid", "GPU-9"),
            ):
                if rng.random() < 0.6:
                    card[name] = _noise(rng) if rng.random() < 0.3 else good
            cards.append(card if rng.random() < 0.95 else _noise(rng))
        body["accelerators"] = cards if rng.random() < 0.95 else _noise(rng)
    return body if rng.random() < 0.97 else _noise(rng)


def _plain(data: Any) -> Any:
    return json.loads(json.dumps(data))


def test_the_heartbeat_reader_agrees_with_the_serializer() -> None:
    rng = random.Random(20261202)
    accepted = 0
    for _ in range(3000):
        body = _payload(rng)
        ours = payloads.heartbeat(body)
        serializer = HeartbeatInSerializer(data=body)
        valid = serializer.is_valid()
        if ours is not None:
            accepted += 1
            assert valid, (body, serializer.errors)
            assert _plain(ours) == _plain(serializer.validated_data), body
            assert all(type(c["utilization_percent"]) is float for c in ours["accelerators"])
    assert accepted > 300, "the reader accepts the common payloads"
    assert payloads.heartbeat(_beat()) is not None


def test_the_command_query_reader_agrees_with_the_serializer() -> None:
    from controlplane.deployments.api.serializers import CommandFetchSerializer

    cases = [
        {"session": ["s1"]},
        {"session": ["s1"], "wait": ["20"]},
        {"session": ["s1"], "wait": ["0.5"]},
        {"session": ["s1"], "wait": ["61"]},
        {"session": ["a b"]},
        {"session": ["x" * 65]},
        {"session": ["s1", "s2"]},
        {"wait": ["1"]},
        {"session": ["s1"], "wait": ["-1"]},
        {"session": ["s1"], "wait": ["nan"]},
        {"session": ["s1"], "extra": ["1"]},
        {"session": [""]},
        {"session": ["ok_-9"], "wait": ["60"]},
    ]
    for query in cases:
        ours = payloads.command_query(query)
        serializer = CommandFetchSerializer(data={k: v[-1] for k, v in query.items()})
        if ours is not None:
            assert serializer.is_valid(), (query, serializer.errors)
            data = serializer.validated_data
            assert ours == (data["session"], data["wait"]), query
    assert payloads.command_query({"session": ["s1"], "wait": ["20"]}) == ("s1", 20.0)


def test_an_unchanged_inventory_is_answered_and_a_changed_one_stored(gateway: Running) -> None:
    node = _node("online")
    client = _agent(node)
    url = f"{gateway.url}/api/v1/nodes/{node.pk}/inventory"
    report = copy.deepcopy(KUNPENG)
    report["accelerators"][0]["preset"] = "a100-80gb"  # an agent-only field: not stored
    first = client.put(url, json=report)
    assert first.status_code == 200 and first.json()["changed"] is True
    assert gateway.gateway.proxied == 1
    again = client.put(url, json=report)
    assert again.json() == {"changed": False, "inventory_hash": first.json()["inventory_hash"]}
    assert gateway.gateway.proxied == 1, "answered by the gateway"
    report["hostname"] = "kp-02"
    changed = client.put(url, json=report)
    assert changed.status_code == 200 and changed.json()["changed"] is True
    assert gateway.gateway.proxied == 2
    node.refresh_from_db()
    assert node.inventory_hash == changed.json()["inventory_hash"]


@pytest.mark.process
def test_syshax_gateway_serves_in_front_of_the_web_server(live_server: Any) -> None:
    """The command itself: Django set up, the loop started, requests handed on."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "syshax.cli",
            "gateway",
            "--bind",
            f"127.0.0.1:{port}",
            "--upstream",
            live_server.url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the gateway never listened"
                time.sleep(0.2)
        assert health.status_code == 200 and health.json()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.process
def test_syshax_gateway_names_a_bad_option() -> None:
    for option, value, limit in (
        ("--bind", "nowhere", "HOST:PORT"),
        ("--snapshot-interval", "9", "5"),
        ("--switch-interval", "1", "0.1"),
        ("--idle-timeout", "0.1", "3600"),
        ("--max-connections", "3", "1000000"),
        ("--max-connections", "many", "1000000"),
    ):
        bad = subprocess.run(
            [sys.executable, "-m", "syshax.cli", "gateway", option, value],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and option in bad.stderr and limit in bad.stderr, option


def test_the_commands_switch_interval_is_the_servers() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).switch_interval == SWITCH_INTERVAL


# --- routers' stats --------------------------------------------------------------------------


def _router(name: str) -> tuple[RouterInstance, httpx.Client]:
    credential, token = MachineCredential.issue("router", name)
    router = register_router(credential, name=name, version="1", listen_url="")
    return router, httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _stats(**changes: Any) -> dict[str, Any]:
    return {
        "policy_version": 3,
        "uptime_seconds": 12.5,
        "requests_total": 40,
        "request_rate": 2,
        "decisions": {"pd": 30, "gpu-only": 10},
        "outcomes": {"ok": 39, "client_gone": 1},
        "ttft_p50_ms": 41.0,
        "ttft_p99_ms": None,
        "backend_errors": 0,
        "fallbacks": 1,
        **changes,
    }


def _stored(router: RouterInstance) -> dict[str, Any]:
    router.refresh_from_db()
    stats = dict(router.stats)
    received = stats.pop("received_at")
    assert received == router.last_seen_at.isoformat()  # type: ignore[union-attr]
    samples = list(router.samples.values("request_rate", "decisions", "policy_version"))
    return {
        "policy_version": router.policy_version,
        "request_rate": router.request_rate,
        "stats": stats,
        "samples": samples,
    }


def test_a_routers_stats_are_answered_and_stored_as_the_control_plane_would(
    gateway: Running,
) -> None:
    (ours, via_gateway), (theirs, direct) = _router("r-gateway"), _router("r-direct")
    body = _stats(extra_field="dropped, as the serializer drops it")
    a = via_gateway.post(f"{gateway.url}/api/v1/routers/{ours.pk}/stats", json=body)
    b = direct.post(f"{gateway.gateway.upstream}/api/v1/routers/{theirs.pk}/stats", json=body)
    assert a.status_code == b.status_code == 200 and a.json() == b.json() == {"accepted": True}
    assert gateway.gateway.stats.written == 1 and gateway.gateway.proxied == 0
    assert _stored(ours) == _stored(theirs)
    assert _stored(ours)["stats"]["request_rate"] == 2.0 and "extra_field" not in ours.stats
    assert "1 router stats in 1 batches" in gateway.gateway.report()


def test_stats_the_control_plane_would_refuse_go_to_it(gateway: Running) -> None:
    (mine, client), (other, _) = _router("r-mine"), _router("r-other")
    url = f"{gateway.url}/api/v1/routers/{{}}/stats"
    foreign = client.post(url.format(other.pk), json=_stats())
    assert foreign.status_code == 403 and "its own stats" in foreign.json()["error"]["message"]
    assert client.post(url.format(other.pk + 1000), json=_stats()).status_code == 404
    bad = client.post(url.format(mine.pk), json=_stats(decisions={"warp": 1}))
    assert bad.status_code == 400 and "warp" in bad.text
    assert gateway.gateway.stats.written == 0 and gateway.gateway.stats.batches == 2
    assert gateway.gateway.proxied == 3
    agent = _agent(_node("online"))
    assert agent.post(url.format(mine.pk), json=_stats()).status_code == 403
    other.refresh_from_db()
    assert other.samples.count() == 0 and mine.samples.count() == 0


def test_routers_stats_in_one_batch_are_one_statement_on_postgresql() -> None:
    (first, _), (second, _) = _router("r-1"), _router("r-2")
    reports = [
        (first.pk, first.credential_id, _stats(request_rate=1.0, policy_version=None)),
        (second.pk, first.credential_id, _stats()),  # not that credential's router
        (first.pk, first.credential_id, _stats(request_rate=5.0)),
    ]
    with CaptureQueriesContext(connection) as queries:
        stored = record_stats_batch(reports)
    if connection.vendor == "postgresql":
        assert [q["sql"].split()[0].upper() for q in queries.captured_queries] == ["WITH"]
    assert stored == {(first.pk, first.credential_id)}
    first.refresh_from_db()
    assert first.request_rate == 5.0 and first.policy_version == 3
    rates = sorted(first.samples.values_list("request_rate", "policy_version"))
    assert rates == [(1.0, None), (5.0, 3)]
    assert second.samples.count() == 0


def _stats_noise(rng: random.Random) -> Any:
    body: dict[str, Any] = {}
    for name, good in _stats().items():
        if rng.random() < 0.7:
            body[name] = _noise(rng) if rng.random() < 0.3 else good
    for field in ("decisions", "outcomes"):
        if field in body and type(body[field]) is dict and rng.random() < 0.3:
            key = rng.choice(["pd", "rejected", "warp", "x\x00y", "ok"])
            body[field] = {**body[field], key: _noise(rng)}
    return body if rng.random() < 0.97 else _noise(rng)


def test_the_stats_reader_agrees_with_the_serializer() -> None:
    rng = random.Random(20261203)
    accepted = 0
    for _ in range(3000):
        body = _stats_noise(rng)
        ours = payloads.router_stats(body)
        serializer = StatsSerializer(data=body)
        valid = serializer.is_valid()
        if ours is not None:
            accepted += 1
            assert valid, (body, serializer.errors)
            assert _plain(ours) == _plain(serializer.validated_data), body
            assert all(type(ours[f]) is float for f in ("uptime_seconds", "request_rate"))
    assert accepted > 300, "the reader accepts the common payloads"
    assert payloads.router_stats(_stats()) is not None
