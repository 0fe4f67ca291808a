"""The fleet's hot paths cost a fixed, small number of queries (docs/scale.md).

A heartbeat, whatever number of cards it reports, and a router's conditional GET that has
nothing new are counted as a real request runs them: the token's ``last_used_at`` already
fresh, as it is for all but one request in TOKEN_LAST_USED_SECONDS.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.inventory.choices import NodeStatus
from controlplane.inventory.models import Accelerator, Node
from controlplane.policy.services import ensure_default_policy
from testbed.factories import build_node

# Authenticate; load the node; the transaction: INSERT the heartbeat, UPDATE every card,
# UPDATE the node. BEGIN and COMMIT are counted on PostgreSQL and are savepoints in a test.
HEARTBEAT_QUERIES = 5
TRANSACTION_STATEMENTS = 2
# Authenticate; read the policy (or the running deployments) the ETag is made of.
NOT_MODIFIED_QUERIES = 2
# Authenticate; is anything queued for this session (no transaction, no row lock).
EMPTY_FETCH_QUERIES = 2


def _queries(ctx: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in ctx.captured_queries]


def _beat(node: Node, utilization: float = 40.0) -> dict[str, Any]:
    return {
        "cpu_percent": 12.5,
        "memory_used_bytes": 1024,
        "memory_total_bytes": 4096,
        "inventory_hash": node.inventory_hash,
        "accelerators": [
            {
                "uuid": card.uuid,
                "utilization_percent": utilization,
                "memory_used_bytes": 5 * 1024**3,
                "temperature_c": 55.0,
                "simulated": True,
            }
            for card in node.accelerators.all()
        ],
    }


@pytest.fixture
def eight_card_node(db: Any) -> Node:
    return build_node("node-a", accelerators=8)


@pytest.fixture
def agent_of_eight(eight_card_node: Node) -> Any:
    from rest_framework.test import APIClient

    from controlplane.access.models import MachineCredential

    client = APIClient()
    token = MachineCredential.issue("agent", "agent-a", node=eight_card_node)[1]
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.mark.parametrize("cards", [0, 1, 8])
def test_a_heartbeat_costs_the_same_queries_for_any_number_of_cards(make_node, cards: int) -> None:
    from rest_framework.test import APIClient

    from controlplane.access.models import MachineCredential

    node = make_node("node-a", accelerators=cards)
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Bearer {MachineCredential.issue('agent', 'a', node=node)[1]}"
    )
    url = f"/api/v1/nodes/{node.pk}/heartbeat"
    assert client.post(url, _beat(node), format="json").status_code == 200  # comes online
    beat = _beat(node, utilization=60.0)
    with CaptureQueriesContext(connection) as ctx:
        response = client.post(url, beat, format="json")
    assert response.status_code == 200
    statements = [sql for sql in _queries(ctx) if "SAVEPOINT" not in sql]
    transaction = [sql for sql in statements if sql in ("BEGIN", "COMMIT")]
    assert len(transaction) <= TRANSACTION_STATEMENTS
    work = [sql for sql in statements if sql not in transaction]
    # No card, no UPDATE of the cards.
    assert len(work) == (HEARTBEAT_QUERIES if cards else HEARTBEAT_QUERIES - 1), work


def test_a_fetch_with_nothing_queued_costs_two_queries(eight_card_node: Node, agent_of_eight):
    from controlplane.deployments.models import AgentCommand

    url = "/api/v1/agent/commands"
    assert agent_of_eight.get(url, {"session": "s1", "wait": "0"}).json() == {"commands": []}
    with CaptureQueriesContext(connection) as ctx:
        answer = agent_of_eight.get(url, {"session": "s1", "wait": "0"})
    assert answer.json() == {"commands": []}
    assert len(ctx.captured_queries) == EMPTY_FETCH_QUERIES, _queries(ctx)
    # With a command queued, it is handed out (with the node's name) once per session.
    command = AgentCommand.objects.create(node=eight_card_node, action="stop", role="gpu")
    handed = agent_of_eight.get(url, {"session": "s1", "wait": "0"}).json()["commands"]
    assert [(c["dispatch_id"], c["node"]) for c in handed] == [
        (str(command.dispatch_id), eight_card_node.name)
    ]
    assert agent_of_eight.get(url, {"session": "s1", "wait": "0"}).json() == {"commands": []}


def test_one_update_stores_every_cards_readings(eight_card_node: Node, agent_of_eight) -> None:
    node = eight_card_node
    beat = _beat(node)
    beat["accelerators"][3] |= {"utilization_percent": 97.5, "temperature_c": None}
    response = agent_of_eight.post(f"/api/v1/nodes/{node.pk}/heartbeat", beat, format="json")
    assert response.status_code == 200
    cards = {card.index: card for card in Accelerator.objects.filter(node=node)}
    assert cards[3].utilization_percent == 97.5
    assert cards[3].temperature_c is None
    assert cards[0].utilization_percent == 40.0
    assert cards[0].temperature_c == 55.0
    assert {card.memory_used_bytes for card in cards.values()} == {5 * 1024**3}


def test_the_answer_is_current_on_the_one_query_path(eight_card_node: Node, agent_of_eight) -> None:
    node = eight_card_node
    url = f"/api/v1/nodes/{node.pk}/heartbeat"
    first = agent_of_eight.post(url, _beat(node), format="json").json()
    assert first["status"] == NodeStatus.ONLINE
    again = agent_of_eight.post(url, _beat(node), format="json").json()
    assert again == first
    node.refresh_from_db()
    assert again["inventory_hash"] == node.inventory_hash


def test_a_node_marked_offline_after_it_was_read_comes_back(
    eight_card_node: Node, agent_of_eight, monkeypatch
) -> None:
    """The reaper may mark the node offline between the heartbeat's read and its write: the
    compare-and-set on the status read misses, and the node comes online all the same."""
    from controlplane.inventory import services

    node = eight_card_node
    url = f"/api/v1/nodes/{node.pk}/heartbeat"
    agent_of_eight.post(url, _beat(node), format="json")
    real = services._mark_seen

    def reaped_meanwhile(seen: Node, now: Any) -> bool:
        Node.objects.filter(pk=seen.pk).update(status=NodeStatus.OFFLINE)
        return real(seen, now)

    monkeypatch.setattr(services, "_mark_seen", reaped_meanwhile)
    answer = agent_of_eight.post(url, _beat(node), format="json").json()
    assert answer["status"] == NodeStatus.ONLINE
    node.refresh_from_db()
    assert node.status == NodeStatus.ONLINE


@pytest.mark.parametrize(
    "path", ["/api/v1/routing/policies/default", "/api/v1/routing/deployments"]
)
def test_a_304_costs_at_most_two_queries(
    path: str, router_client, make_deployment, django_assert_max_num_queries
) -> None:
    ensure_default_policy()
    make_deployment(state="running", gpu_endpoint="http://127.0.0.1:7001")
    etag = router_client.get(path)["ETag"]
    with django_assert_max_num_queries(NOT_MODIFIED_QUERIES):
        response = router_client.get(path, HTTP_IF_NONE_MATCH=etag)
    assert response.status_code == 304
    assert response["ETag"] == etag


# ---------------------------------------------------------------- every list and detail


def _one_of_each(i: int) -> dict[str, Any]:
    """One row of every resource the API lists (``i`` keeps names and ports apart)."""
    from controlplane.access.models import MachineCredential
    from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample, Scenario
    from controlplane.deployments.models import AgentCommand, ContainerInstance
    from controlplane.policy.services import create_policy
    from controlplane.routers.models import RouterInstance
    from testbed.factories import build_deployment, build_profile

    node = build_node(f"count-{i}", accelerators=2, labels={"rack": f"r{i}"})
    profile = build_profile(gpu_port=9000 + 2 * i, cpu_port=9001 + 2 * i)
    deployment = build_deployment(node, profile, state="running", generation=1)
    container = ContainerInstance.objects.create(
        deployment=deployment, role="gpu", generation=1, name=f"c-{i}", status="running"
    )
    command = AgentCommand.objects.create(
        node=node, deployment=deployment, action="start", role="gpu", generation=1, step=""
    )
    credential, _ = MachineCredential.issue("agent", f"agent-count-{i}", node=node)
    router_credential, _ = MachineCredential.issue("router", f"router-count-{i}")
    router = RouterInstance.objects.create(name=f"router-{i}", credential=router_credential)
    policy = create_policy(f"policy-{i}", acting_user="t", reason="count")
    scenario = Scenario.objects.create(name=f"scenario-{i}", input_tokens=8, output_tokens=4)
    run = BenchmarkRun.objects.create(scenario=scenario, deployment=deployment, status="succeeded")
    for index in (0, 1):
        BenchmarkSample.objects.create(run=run, mode="gpu", concurrency=1, index=index)
    return {
        "nodes": node.pk,
        "accelerators": node.accelerators.first().pk,
        "credentials": credential.pk,
        "profiles": profile.pk,
        "deployments": deployment.pk,
        "containers": container.pk,
        "commands": command.pk,
        "policies": policy.name,
        "routers": router.pk,
        "scenarios": scenario.name,
        "benchmark-runs": run.pk,
    }


RESOURCES = [
    "nodes",
    "accelerators",
    "credentials",
    "profiles",
    "deployments",
    "containers",
    "commands",
    "policies",
    "routers",
    "scenarios",
    "benchmark-runs",
]
# Exact counts, as NetBox pins them: a change that adds a query per answer shows here. A list
# is its COUNT and its page; a detail its row. A node also lists its cards and NUMA nodes, a
# deployment its containers and held cards (prefetched: one query each, whatever the rows).
RELATED = {"nodes": 2, "deployments": 2}


def _count(client: Any, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, (url, response.content[:300])
    return len([q for q in ctx.captured_queries if "SAVEPOINT" not in q["sql"]])


@pytest.mark.parametrize("resource", RESOURCES)
def test_a_list_costs_the_same_queries_for_one_row_or_many(admin_client, resource) -> None:
    """No query per row (NetBox's rule): four more rows of everything, the same count."""
    _one_of_each(0)
    url = f"/api/v1/{resource}/"
    first = _count(admin_client, url)
    assert first == 2 + RELATED.get(resource, 0)
    for i in range(1, 5):
        _one_of_each(i)
    assert admin_client.get(url).json()["count"] >= 5
    assert _count(admin_client, url) == first


@pytest.mark.parametrize("resource", RESOURCES)
def test_a_detail_costs_a_few_queries(admin_client, resource) -> None:
    keys = _one_of_each(0)
    url = f"/api/v1/{resource}/{keys[resource]}/"
    assert _count(admin_client, url) == 1 + RELATED.get(resource, 0)


def test_the_routing_payload_costs_the_same_queries_for_one_deployment_or_many(
    router_client,
) -> None:
    _one_of_each(0)
    router_client.get("/api/v1/routing/deployments")  # the token's last_used_at written once
    first = _count(router_client, "/api/v1/routing/deployments")
    for i in range(1, 5):
        _one_of_each(i)
    assert len(router_client.get("/api/v1/routing/deployments").json()["deployments"]) == 5
    assert _count(router_client, "/api/v1/routing/deployments") == first
