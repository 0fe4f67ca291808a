from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from controlplane.deployments.models import Deployment
from controlplane.inventory import services
from controlplane.inventory.models import Heartbeat, Node

KUNPENG = {
    "agent_version": "0.1.0",
    "hostname": "kp-01",
    "address": "10.0.0.5",
    "cpu": {
        "model": "Kunpeng 920 7280Z",
        "architecture": "aarch64",
        "sockets": 2,
        "physical_cores": 160,
        "threads": 160,
        "isa_flags": ["asimd", "sve", "i8mm"],
        "memory_total_bytes": 512 * 1024**3,
    },
    "numa_nodes": [
        {"index": i, "cpus": f"{i * 40}-{i * 40 + 39}", "memory_total_bytes": 128 * 1024**3}
        for i in range(4)
    ],
    "accelerators": [
        {
            "kind": "gpu",
            "vendor": "NVIDIA",
            "model": "A100-SXM4-80GB",
            "index": 0,
            "uuid": "GPU-1",
            "memory_total_bytes": 80 * 1024**3,
            "simulated": True,
        }
    ],
}


def test_inventory_is_stored_and_rewritten_only_when_it_changes(node, agent_client) -> None:
    first = agent_client.put(f"/api/v1/nodes/{node.pk}/inventory", KUNPENG, format="json")
    assert first.status_code == 200 and first.json()["changed"] is True
    node.refresh_from_db()
    assert node.cpu.physical_cores == 160
    assert [n.cpus for n in node.numa_nodes.all()] == ["0-39", "40-79", "80-119", "120-159"]
    assert node.accelerators.get().simulated is True
    stamp = node.inventory_updated_at
    again = agent_client.put(f"/api/v1/nodes/{node.pk}/inventory", KUNPENG, format="json")
    assert again.json() == {"changed": False, "inventory_hash": node.inventory_hash}
    node.refresh_from_db()
    assert node.inventory_updated_at == stamp


def test_inventory_with_bad_numbers_names_the_field(node, agent_client) -> None:
    bad = {**KUNPENG, "cpu": {**KUNPENG["cpu"], "threads": 80}}
    response = agent_client.put(f"/api/v1/nodes/{node.pk}/inventory", bad, format="json")
    assert response.status_code == 400
    assert "threads" in response.json()["error"]["message"]
    assert "physical_cores (160)" in response.json()["error"]["message"]
    bad = {**KUNPENG, "numa_nodes": [{"index": 0, "cpus": "0-x"}]}
    response = agent_client.put(f"/api/v1/nodes/{node.pk}/inventory", bad, format="json")
    assert response.status_code == 400
    assert "cpus" in str(response.json()["error"]["fields"])


def test_a_heartbeat_writes_one_row_and_brings_the_node_online(node, agent_client) -> None:
    agent_client.put(f"/api/v1/nodes/{node.pk}/inventory", KUNPENG, format="json")
    response = agent_client.post(
        f"/api/v1/nodes/{node.pk}/heartbeat",
        {
            "cpu_percent": 37.5,
            "memory_used_bytes": 10,
            "accelerators": [
                {
                    "uuid": "GPU-1",
                    "utilization_percent": 61.0,
                    "memory_used_bytes": 5,
                    "temperature_c": 55,
                }
            ],
        },
        format="json",
    )
    assert response.status_code == 200
    assert response.json()["status"] == "online"
    assert Heartbeat.objects.filter(node=node).count() == 1
    accelerator = node.accelerators.get()
    assert (accelerator.utilization_percent, accelerator.temperature_c) == (61.0, 55.0)


def test_the_control_plane_s_own_outage_is_not_counted_against_the_nodes(
    node, agent_client, settings
) -> None:
    from controlplane.core.models import Clock

    settings.HEARTBEAT_INTERVAL_SECONDS = 1.0
    settings.HEARTBEAT_TOLERANCE = 3.0
    agent_client.post(f"/api/v1/nodes/{node.pk}/heartbeat", {}, format="json")
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=60))
    # The reaper last ran 60 s ago: the control plane was down, and could not hear the node.
    Clock.objects.filter(name="reaper-ran").update(at=timezone.now() - timedelta(seconds=60))
    assert services.mark_lost_nodes() == []
    assert services.mark_lost_nodes() == []  # listening again, for less than the grace period
    Clock.objects.filter(name="reaper-resumed").update(at=timezone.now() - timedelta(seconds=3.5))
    assert services.mark_lost_nodes() == [node.pk]  # a whole grace period heard nothing


def test_a_silent_node_goes_offline_its_deployments_unknown_and_it_comes_back(
    node, agent_client, make_deployment, settings
) -> None:
    settings.HEARTBEAT_INTERVAL_SECONDS = 1.0
    settings.HEARTBEAT_TOLERANCE = 3.0
    deployment = make_deployment(node=node, state="running", desired_state="running")
    agent_client.post(f"/api/v1/nodes/{node.pk}/heartbeat", {}, format="json")
    assert services.mark_lost_nodes() == []
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=4))
    assert services.mark_lost_nodes() == [node.pk]
    node.refresh_from_db()
    deployment.refresh_from_db()
    assert node.status == "offline"
    assert deployment.state == "unknown"
    assert "stopped heartbeating" in deployment.state_reason
    # It returns without registering again.
    response = agent_client.post(f"/api/v1/nodes/{node.pk}/heartbeat", {}, format="json")
    assert response.json()["status"] == "online"


def test_a_draining_node_stays_draining_while_it_heartbeats(
    node, agent_client, admin_client
) -> None:
    assert (
        admin_client.patch(
            f"/api/v1/nodes/{node.pk}/", {"status": "draining"}, format="json"
        ).status_code
        == 200
    )
    agent_client.post(f"/api/v1/nodes/{node.pk}/heartbeat", {}, format="json")
    node.refresh_from_db()
    assert node.status == "draining"
    response = admin_client.patch(f"/api/v1/nodes/{node.pk}/", {"status": "offline"}, format="json")
    assert response.status_code == 400
    assert "draining" in response.json()["error"]["message"]


def test_agent_self_tells_the_agent_its_node_and_fetch_wait(node, agent_client, settings) -> None:
    body = agent_client.get("/api/v1/agent/self").json()
    assert body["node"]["name"] == "node-a"
    assert body["command_wait_seconds"] == settings.AGENT_COMMAND_WAIT_SECONDS
    assert not {"broker_url", "command_queue", "broker_transport_options"} & set(body)


def test_node_returning_settles_unknown_deployments_from_reported_containers(
    node, agent_client, make_deployment
) -> None:
    deployment = make_deployment(node=node, state="unknown", desired_state="running", generation=2)
    report = {
        "containers": [
            {
                "deployment_id": deployment.pk,
                "generation": 2,
                "role": role,
                "status": "running",
                "health": "healthy",
            }
            for role in ("gpu", "cpu")
        ]
    }
    assert (
        agent_client.put(f"/api/v1/nodes/{node.pk}/containers", report, format="json").status_code
        == 200
    )
    assert Deployment.objects.get(pk=deployment.pk).state == "running"


def test_a_deploy_interrupted_by_a_lost_node_resumes_when_the_node_returns(
    node, make_deployment, django_capture_on_commit_callbacks
) -> None:
    from controlplane.deployments import services as deployment_services

    deployment = make_deployment(
        node=node, state="deploying", desired_state="running", generation=1, step="start-gpu"
    )
    deployment_services.mark_node_deployments_unknown(node)
    deployment.refresh_from_db()
    assert deployment.state == "unknown"
    with django_capture_on_commit_callbacks() as queued:
        deployment_services.sync_containers(node, [])  # the agent is back, nothing running yet
    deployment.refresh_from_db()
    assert (deployment.state, deployment.step) == ("deploying", "start-gpu")
    assert deployment.state_reason == "node is back; resuming at start-gpu"
    assert queued  # advance queued: the workflow carries on from its step


def _with_cards(count: int, memory_gb: int = 80) -> dict:
    card = KUNPENG["accelerators"][0]
    cards = [
        {**card, "index": i, "uuid": f"GPU-{i}", "memory_total_bytes": memory_gb * 1024**3}
        for i in range(count)
    ]
    return {**KUNPENG, "accelerators": cards}


def test_a_changed_inventory_costs_the_same_queries_for_one_card_or_eight(
    make_node, django_assert_num_queries
) -> None:
    from rest_framework.test import APIClient

    from controlplane.access.models import MachineCredential

    counts = []
    for cards in (1, 8):
        node = make_node(f"node-{cards}")
        client = APIClient()
        token = MachineCredential.issue("agent", f"a-{cards}", node=node)[1]
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        url = f"/api/v1/nodes/{node.pk}/inventory"
        assert client.put(url, _with_cards(cards), format="json").json()["changed"]
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as ctx:
            answer = client.put(url, _with_cards(cards, memory_gb=40), format="json")
        assert answer.json()["changed"] is True
        counts.append(len([q for q in ctx.captured_queries if "SAVEPOINT" not in q["sql"]]))
        node.refresh_from_db()
        assert [a.memory_total_bytes for a in node.accelerators.all()] == [40 * 1024**3] * cards
    assert counts[0] == counts[1] <= 11, counts  # 28 for eight cards with a write per card


def test_a_card_that_left_is_removed_and_a_replacement_takes_its_index(node, agent_client) -> None:
    url = f"/api/v1/nodes/{node.pk}/inventory"
    agent_client.put(url, _with_cards(2), format="json")
    first = node.accelerators.get(uuid="GPU-0")
    replaced = _with_cards(2)
    replaced["accelerators"][1] = {**replaced["accelerators"][1], "uuid": "GPU-new"}
    assert agent_client.put(url, replaced, format="json").json()["changed"] is True
    cards = {a.uuid: (a.pk, a.index) for a in node.accelerators.all()}
    assert cards == {"GPU-0": (first.pk, 0), "GPU-new": (cards["GPU-new"][0], 1)}
