from __future__ import annotations

from typing import Any

import pytest

from controlplane.deployments import workflow
from controlplane.deployments.models import AgentCommand, Deployment


def create(client, node, profile, **extra: Any):
    return client.post(
        "/api/v1/deployments/",
        {"name": "dep-1", "node": node.pk, "profile": profile.pk, **extra},
        format="json",
    )


def test_tensor_parallel_larger_than_the_node_is_a_400_naming_both_numbers(
    admin_client, node, make_profile
) -> None:
    response = create(admin_client, node, make_profile(tensor_parallel_size=4))
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("tensor_parallel_size")
    assert "is 4" in message and "1 accelerator(s)" in message


def test_cards_under_20_gb_are_refused(admin_client, make_node, make_profile) -> None:
    small = make_node("small", accel_gb=16)
    response = create(admin_client, small, make_profile())
    assert response.status_code == 400
    assert "16.0 GB; each card needs at least 20 GB" in response.json()["error"]["message"]


@pytest.mark.parametrize("value", [0, -0.1, 1.01])
def test_gpu_memory_utilization_must_be_in_0_1(admin_client, value) -> None:
    response = admin_client.post(
        "/api/v1/profiles/",
        {"name": "p", "model": "m", "gpu_memory_utilization": value},
        format="json",
    )
    assert response.status_code == 400
    assert (
        response.json()["error"]["message"]
        == f"gpu_memory_utilization: must be in (0, 1]; got {value}"
    )


def test_explicit_affinity_must_lie_within_the_node(admin_client, node, make_profile) -> None:
    profile = make_profile(cpu_affinity_mode="explicit", cpu_affinity="0-3,6-11")
    response = create(admin_client, node, profile)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "cpu_affinity: CPUs 8-11 are outside node 'node-a''s cores 0-7"
    )


def test_a_kv_arena_larger_than_the_gpu_containers_shm_is_refused(admin_client) -> None:
    body = {"name": "p", "model": "m", "engine": "vllm", "gpu_shm_size_gb": 2}
    response = admin_client.post("/api/v1/profiles/", {**body, "kv_arena_mib": 1537}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "kv_arena_mib: must fit the GPU container's /dev/shm (gpu_shm_size_gb 2 GiB, less 512 "
        "MiB for vLLM): at most 1536 MiB; got 1537"
    )
    fits = admin_client.post("/api/v1/profiles/", {**body, "kv_arena_mib": 1536}, format="json")
    assert fits.status_code == 201, fits.json()


def test_same_ports_for_both_engines_is_refused(admin_client) -> None:
    response = admin_client.post(
        "/api/v1/profiles/",
        {"name": "p", "model": "m", "gpu_port": 7001, "cpu_port": 7001},
        format="json",
    )
    assert response.status_code == 400
    assert "must differ from gpu_port (7001)" in response.json()["error"]["message"]


def agent_reports(agent_client, command: AgentCommand, status: str = "succeeded", detail: str = ""):
    return agent_client.post(
        f"/api/v1/commands/{command.dispatch_id}/result",
        {"status": status, "detail": detail},
        format="json",
    )


def pending(deployment: Deployment) -> AgentCommand:
    return AgentCommand.objects.get(
        deployment=deployment, generation=deployment.generation, step=deployment.step
    )


def test_deploy_runs_gpu_before_cpu_and_publishes_endpoints(
    admin_client, agent_client, node, make_profile, django_capture_on_commit_callbacks
) -> None:
    with django_capture_on_commit_callbacks():
        response = create(admin_client, node, make_profile(), start=True)
    assert response.status_code == 201, response.content
    deployment = Deployment.objects.get(pk=response.json()["id"])
    order = []
    for _ in range(4):
        workflow.advance(deployment.pk)
        deployment.refresh_from_db()
        command = pending(deployment)
        order.append(command.step)
        # advance is idempotent: a second run sends nothing new.
        workflow.advance(deployment.pk)
        assert AgentCommand.objects.filter(deployment=deployment).count() == len(order)
        assert agent_reports(agent_client, command).json() == {"accepted": True, "duplicate": False}
        assert agent_reports(agent_client, command).json()["duplicate"] is True
    workflow.advance(deployment.pk)
    deployment.refresh_from_db()
    assert order == ["stop-old-cpu", "stop-old-gpu", "start-gpu", "start-cpu"]
    assert deployment.state == "running"
    assert (deployment.gpu_endpoint, deployment.cpu_endpoint) == (
        "http://127.0.0.1:7001",
        "http://127.0.0.1:7002",
    )
    start_cpu = AgentCommand.objects.get(deployment=deployment, step="start-cpu")
    assert (
        start_cpu.spec["ipc_peer"]
        == AgentCommand.objects.get(deployment=deployment, step="start-gpu").spec["name"]
    )
    steps = [e.step for e in deployment.events.all()]
    assert steps[-1] == "running"


def test_a_failed_cpu_engine_fails_the_deployment_and_cleans_up(
    admin_client, agent_client, node, make_profile
) -> None:
    deployment = Deployment.objects.get(
        pk=create(admin_client, node, make_profile(), start=True).json()["id"]
    )
    for _ in range(3):
        workflow.advance(deployment.pk)
        deployment.refresh_from_db()
        agent_reports(agent_client, pending(deployment))
    workflow.advance(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.step == "start-cpu"
    agent_reports(
        agent_client,
        pending(deployment),
        "failed",
        "CPU engine exited with code 1: OSError: no KV segment",
    )
    workflow.advance(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.state == "failed"
    assert deployment.state_reason == "CPU engine exited with code 1: OSError: no KV segment"
    cleanup = AgentCommand.objects.filter(deployment=deployment, step__startswith="cleanup")
    assert sorted(c.role for c in cleanup) == ["cpu", "gpu"]
    assert all(c.spec["keep_generation"] is None for c in cleanup)


def test_another_agent_cannot_report_this_nodes_command(
    admin_client, other_agent_client, node, make_profile
) -> None:
    deployment = Deployment.objects.get(
        pk=create(admin_client, node, make_profile(), start=True).json()["id"]
    )
    workflow.advance(deployment.pk)
    deployment.refresh_from_db()
    response = agent_reports(other_agent_client, pending(deployment))
    assert response.status_code == 403
    assert pending(deployment).status == "queued"


def test_deploying_plans_the_cpu_engine_over_the_numa_nodes(
    admin_client, node, make_profile
) -> None:
    response = create(admin_client, node, make_profile(), start=True)
    plan = Deployment.objects.get(pk=response.json()["id"]).affinity_plan
    # node-a: 2 NUMA nodes x 4 cores; 2 cores kept for the GPU engine's host threads.
    assert plan["physical_cores"] == 6
    # The two host cores come from NUMA 0 (the GPU's node), so NUMA 1 gives all four.
    assert plan["cores_per_numa_node"] == {"0": 2, "1": 4}
    assert (plan["gpu_cpuset"], plan["cpuset"]) == ("0-1", "2-7")
    assert plan["omp_num_threads"] == 6
    assert plan["gpu_cpuset"]


def test_cores_held_by_another_deployment_are_not_available(
    admin_client, node, make_profile, make_deployment
) -> None:
    make_deployment(node=node, state="running", affinity_plan={"cpuset": "0-3"})
    profile = make_profile(cpu_affinity_mode="explicit", cpu_affinity="2-5")
    response = create(admin_client, node, profile)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("cpu_affinity: CPUs 2-3 are held by")


def test_omp_threads_must_be_1_to_1_5x_the_cores(admin_client, node, make_profile) -> None:
    response = create(admin_client, node, make_profile(omp_num_threads=64))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "omp_num_threads: is 64; with 6 physical cores it must be between 6 and 9 "
        "(1-1.5x the cores)"
    )


def test_a_draining_node_takes_no_new_deployment(admin_client, node, make_profile) -> None:
    node.status = "draining"
    node.save()
    response = create(admin_client, node, make_profile())
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "node: node 'node-a' is draining"
