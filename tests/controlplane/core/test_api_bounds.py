"""Inputs that once made the API answer 500 or do unbounded work get a 4xx naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.benchmarks.models import BenchmarkRun, Scenario

INVENTORY: dict[str, Any] = {
    "cpu": {
        "model_name": "x",
        "architecture": "x86_64",
        "sockets": 1,
        "physical_cores": 2,
        "threads": 2,
        "memory_total_bytes": 1,
    },
    "numa_nodes": [{"index": 0, "cpus": "0-1", "memory_total_bytes": 1}],
    "accelerators": [
        {"kind": "gpu", "vendor": "N", "index": 0, "uuid": "GPU-a", "memory_total_bytes": 1}
    ],
}


def error(response) -> str:
    assert response["Content-Type"] == "application/json"
    return response.json()["error"]["message"]


def test_a_policy_without_a_name_is_a_400(admin_client) -> None:
    response = admin_client.post("/api/v1/policies/", {"reason": "0"}, format="json")
    assert response.status_code == 400
    assert error(response) == "name: This field is required."


def test_deleting_what_a_deployment_uses_is_a_409_naming_it(
    admin_client, node, make_deployment
) -> None:
    deployment = make_deployment(node=node, name="keeps-it")
    for url in (f"/api/v1/nodes/{node.pk}/", f"/api/v1/profiles/{deployment.profile.pk}/"):
        response = admin_client.delete(url)
        assert response.status_code == 409
        assert error(response) == "cannot delete it while it is still used by deployments: keeps-it"


def test_a_deployment_that_is_a_runs_only_target_is_kept(admin_client, make_deployment) -> None:
    deployment = make_deployment()
    BenchmarkRun.objects.create(scenario=Scenario.objects.get(name="short"), deployment=deployment)
    response = admin_client.delete(f"/api/v1/deployments/{deployment.pk}/")
    assert response.status_code == 409
    assert "only target of 1 benchmark run" in error(response)


def test_a_running_deployment_cannot_be_moved(admin_client, make_deployment, other_node) -> None:
    deployment = make_deployment(state="running")
    response = admin_client.patch(
        f"/api/v1/deployments/{deployment.pk}/", {"node": other_node.pk}, format="json"
    )
    assert response.status_code == 400
    assert error(response) == "node: stop the deployment first (it is running)"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda inv: inv["accelerators"].append({**inv["accelerators"][0], "uuid": "GPU-b"}),
            "accelerators: accelerator indexes must be unique on a node",
        ),
        (
            lambda inv: inv["numa_nodes"][0].update(cpus="0-5000000"),
            "numa_nodes: 0: cpus: CPU 5000000 is above the largest id, 131071",
        ),
        (
            lambda inv: inv["cpu"].update(memory_total_bytes=2**64),
            "cpu: memory_total_bytes: Ensure this value is less than or equal to",
        ),
    ],
)
def test_inventories_are_checked_before_anything_is_expanded_or_stored(
    agent_client, node, change, message
) -> None:
    inventory = {
        **INVENTORY,
        "cpu": dict(INVENTORY["cpu"]),
        "numa_nodes": [dict(n) for n in INVENTORY["numa_nodes"]],
        "accelerators": [dict(a) for a in INVENTORY["accelerators"]],
    }
    change(inventory)
    response = agent_client.put(f"/api/v1/nodes/{node.pk}/inventory/", inventory, format="json")
    assert response.status_code == 400
    assert error(response).startswith(message)


def test_heartbeat_and_container_numbers_fit_their_columns(
    agent_client, node, make_deployment
) -> None:
    beat = agent_client.post(
        f"/api/v1/nodes/{node.pk}/heartbeat/",
        {"accelerators": [{"uuid": "GPU-node-a-0", "memory_used_bytes": 2**64}]},
        format="json",
    )
    assert beat.status_code == 400 and "memory_used_bytes" in error(beat)
    deployment = make_deployment(node=node)
    report = {
        "containers": [
            {
                "deployment_id": deployment.pk,
                "generation": 2**117,
                "role": "gpu",
                "engine_id": "x",
                "name": "n",
                "status": "running",
            }
        ]
    }
    response = agent_client.put(f"/api/v1/nodes/{node.pk}/containers", report, format="json")
    assert response.status_code == 400
    assert "generation: Ensure this value is less than or equal to 2147483647" in error(response)
    # A deployment id past the id column (found by the API fuzz test) and an exit code past
    # its column are named too, not a database error.
    for field, value, limit in (
        ("deployment_id", 2**70, "9223372036854775807"),
        ("exit_code", 2**40, "2147483647"),
    ):
        entry = {**report["containers"][0], "generation": 1, field: value}
        response = agent_client.put(
            f"/api/v1/nodes/{node.pk}/containers", {"containers": [entry]}, format="json"
        )
        assert response.status_code == 400, (field, response.content)
        assert f"{field}: Ensure this value is less than or equal to {limit}" in error(response)


def test_router_stats_and_rollbacks_fit_their_columns(router_client, admin_client) -> None:
    from controlplane.policy.services import ensure_default_policy

    ensure_default_policy()
    registered = router_client.post(
        "/api/v1/routers/register", {"name": "r-bounds", "version": "1"}, format="json"
    )
    assert registered.status_code in (200, 201), registered.content
    router_id = registered.json()["id"]
    stats = router_client.post(
        f"/api/v1/routers/{router_id}/stats", {"policy_version": 2**40}, format="json"
    )
    assert stats.status_code == 400 and "policy_version" in error(stats)
    rollback = admin_client.post(
        "/api/v1/policies/default/rollback/", {"version": 2**70, "reason": "x"}, format="json"
    )
    assert rollback.status_code == 400 and "version" in error(rollback)


def test_a_person_cannot_set_a_node_to_pending(admin_client, node) -> None:
    node.status = "online"
    node.save()
    response = admin_client.patch(f"/api/v1/nodes/{node.pk}/", {"status": "pending"}, format="json")
    assert response.status_code == 400
    assert "a person may set 'draining', or 'online' on a drained node" in error(response)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("limit=1000000000000", "limit: must be an integer 1-1000, got '1000000000000'"),
        ("limit=0", "limit: must be an integer 1-1000, got '0'"),
        ("offset=-1", "offset: must be an integer at least 0, got '-1'"),
        ("offset=null", "offset: must be an integer at least 0, got 'null'"),
    ],
)
def test_pages_are_capped_and_bad_paging_is_named(admin_client, node, query, message) -> None:
    response = admin_client.get(f"/api/v1/nodes/?{query}")
    assert response.status_code == 400
    assert error(response) == message
    assert admin_client.get("/api/v1/nodes/?limit=1000").status_code == 200


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"concurrency": "1-2000000"},
            "concurrency: each level must be between 1 and 1024; got 1-2000000",
        ),
        (
            {"concurrency": list(range(1, 1100))},
            "concurrency: give at most 1024 concurrency levels",
        ),
        (
            {"concurrency": "1-1024", "iterations": 10000},
            "iterations: the run would send 10,240,000 requests",
        ),
    ],
)
def test_benchmark_work_is_bounded_before_it_is_queued(admin_client, fields, message) -> None:
    body = {"scenario": "short", "target_url": "http://127.0.0.1:7010", **fields}
    response = admin_client.post("/api/v1/benchmark-runs/", body, format="json")
    assert response.status_code == 400
    assert error(response).startswith(message)
    assert not BenchmarkRun.objects.exists()


def test_an_inventory_of_more_than_1024_cards_is_refused(agent_client, node) -> None:
    cards = [
        {"kind": "gpu", "index": i % 1024, "uuid": f"GPU-{i}", "memory_total_bytes": 1}
        for i in range(1025)
    ]
    inventory = {**INVENTORY, "accelerators": cards}
    response = agent_client.put(f"/api/v1/nodes/{node.pk}/inventory/", inventory, format="json")
    assert response.status_code == 400
    assert error(response).startswith("accelerators: Ensure this field has no more than 1024")


def test_a_profile_sets_its_cpu_engine_limit_as_cpu_max_num_seqs(
    admin_client, make_profile
) -> None:
    profile = make_profile()
    url = f"/api/v1/profiles/{profile.pk}/"
    # The old name is the policy's knob now: refused by name, never silently ignored.
    response = admin_client.patch(url, {"cpu_max_batch_size": 4}, format="json")
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert "cpu_max_num_seqs" in fields["cpu_max_batch_size"][0]
    response = admin_client.patch(url, {"cpu_max_num_seqs": 0}, format="json")
    assert response.status_code == 400
    assert "cpu_max_num_seqs" in response.json()["error"]["fields"]
    response = admin_client.patch(url, {"cpu_max_num_seqs": 4}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["cpu_max_num_seqs"] == 4
    profile.refresh_from_db()
    assert profile.cpu_max_num_seqs == 4


def test_a_nul_character_in_any_json_string_is_a_400(agent_client, node) -> None:
    """PostgreSQL cannot store U+0000 in text or jsonb; it once made a command result a 500."""
    from controlplane.deployments.models import AgentCommand

    command = AgentCommand.objects.create(node=node, action="inspect")
    for body in (
        {"status": "succeeded", "output": {"log": "a\x00b"}},
        {"status": "succeeded", "output": {"k\x00": 1}},
        {"status": "succeeded", "detail": ["x", "\x00"]},
    ):
        response = agent_client.post(
            f"/api/v1/commands/{command.dispatch_id}/result", body, format="json"
        )
        assert response.status_code == 400, body
        assert "NUL" in error(response)
    command.refresh_from_db()
    assert command.status == "queued"
