"""The agent no longer decides where routers connect: a node's address is a host name or an IP
literal, engine URLs are built from it by one function (IPv6 in brackets), and an address
stored before the check is never used.

The reproduction: an agent reported ``10.0.0.5:22#``, and routers were sent to
``http://10.0.0.5:22#:7001``, which is port 22.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from controlplane.benchmarks.services import check_target, known_targets
from controlplane.deployments import services, workflow
from controlplane.deployments.models import AgentCommand, Deployment
from controlplane.inventory.models import Node
from tests.controlplane.inventory.test_inventory import KUNPENG

BAD = ["10.0.0.5:22#", "10.0.0.5:22", "evil.example/x", "[2001:db8::5]", "127.1", "a b"]


def _run(deployment: Deployment, agent_client) -> Deployment:
    """Advance ``deployment`` to running, its agent answering every command."""
    for _ in range(6):
        workflow.advance(deployment.pk)
        fetched = agent_client.get("/api/v1/agent/commands", {"session": "s1", "wait": "0"})
        for message in fetched.json()["commands"]:
            agent_client.post(
                f"/api/v1/commands/{message['dispatch_id']}/result",
                {"status": "succeeded"},
                format="json",
            )
    deployment.refresh_from_db()
    assert deployment.state == "running"
    return deployment


def _deploy(node: Node, profile, agent_client) -> Deployment:
    deployment = services.create_deployment(
        name="dep-addr", profile=profile, node=node, acting_user="test", start=True
    )
    return _run(deployment, agent_client)


@pytest.mark.parametrize("address", BAD)
def test_an_agent_reporting_an_address_that_is_not_a_host_gets_a_400_naming_it(
    node, agent_client, address: str
) -> None:
    answer = agent_client.put(
        f"/api/v1/nodes/{node.pk}/inventory", {**KUNPENG, "address": address}, format="json"
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert list(error["fields"]) == ["address"] and "must be a host name" in error["message"]
    node.refresh_from_db()
    assert node.address == "127.0.0.1" and node.inventory_hash == ""


def test_a_person_setting_an_address_that_is_not_a_host_gets_a_400(admin_client, node) -> None:
    answer = admin_client.patch(
        f"/api/v1/nodes/{node.pk}/", {"address": "10.0.0.5:22#"}, format="json"
    )
    assert answer.status_code == 400 and list(answer.json()["error"]["fields"]) == ["address"]
    named = admin_client.patch(
        f"/api/v1/nodes/{node.pk}/", {"address": "gpu-01.lab.example"}, format="json"
    )
    assert named.status_code == 200 and named.json()["address"] == "gpu-01.lab.example"


def test_an_ipv6_nodes_engine_urls_are_bracketed_everywhere(
    node, agent_client, router_client, make_profile
) -> None:
    reported = agent_client.put(
        f"/api/v1/nodes/{node.pk}/inventory", {**KUNPENG, "address": "2001:db8::5"}, format="json"
    )
    assert reported.status_code == 200
    node.refresh_from_db()
    assert node.address == "2001:db8::5"  # stored as reported
    deployment = _deploy(node, make_profile(), agent_client)
    assert deployment.gpu_endpoint == "http://[2001:db8::5]:7001"
    assert deployment.cpu_endpoint == "http://[2001:db8::5]:7002"
    start = AgentCommand.objects.get(deployment=deployment, step="start-gpu")
    assert start.spec["host"] == "2001:db8::5"  # the engine's --host: no brackets
    (entry,) = router_client.get("/api/v1/routing/deployments").json()["deployments"]
    assert (entry["gpu_url"], entry["cpu_url"]) == (
        "http://[2001:db8::5]:7001",
        "http://[2001:db8::5]:7002",
    )
    check_target("http://[2001:db8::5]:7002")  # a benchmark may aim at its engines


def test_an_address_stored_before_the_check_is_never_used(
    node, agent_client, router_client, make_profile, make_deployment
) -> None:
    Node.objects.filter(pk=node.pk).update(address="10.0.0.5:22#")  # no validation
    node.refresh_from_db()
    deployment = _deploy(node, make_profile(), agent_client)
    start = AgentCommand.objects.get(deployment=deployment, step="start-gpu")
    assert start.spec["host"] == "127.0.0.1"  # as a node that reported no address
    assert deployment.gpu_endpoint == "http://127.0.0.1:7001"
    assert not any(host.startswith("10.0.0.5") for host, _ in known_targets())
    # An endpoint built from it back then is not handed to routers.
    make_deployment(
        node=node, name="dep-old", state="running", gpu_endpoint="http://10.0.0.5:22#:7001"
    )
    listed = router_client.get("/api/v1/routing/deployments").json()["deployments"]
    assert [e["name"] for e in listed] == ["dep-addr"]


def test_the_migration_blanks_stored_addresses_that_are_not_hosts(transactional_db) -> None:
    before = [("inventory", "0003_heartbeat_node_index_fillfactor")]
    after = [("inventory", "0004_node_address_is_a_host")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(before)
    try:
        old = MigrationExecutor(connection).loader.project_state(before).apps
        OldNode = old.get_model("inventory", "Node")
        for name, address in (("bad", "10.0.0.5:22#"), ("v6", "2001:db8::5"), ("none", "")):
            OldNode.objects.create(name=name, address=address, inventory_hash=f"hash-{name}")
        MigrationExecutor(connection).migrate(after)
    finally:
        MigrationExecutor(connection).migrate(latest)  # the rest of the suite's schema
    stored = {n.name: (n.address, n.inventory_hash) for n in Node.objects.all()}
    # A blank hash makes the agent report again (and the gateway stop answering its old one).
    assert stored == {
        "bad": ("", ""),
        "v6": ("2001:db8::5", "hash-v6"),
        "none": ("", "hash-none"),
    }
