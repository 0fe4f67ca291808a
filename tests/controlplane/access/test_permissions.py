"""The permissions matrix: every endpoint against every kind of caller.

Callers: anonymous, user (an operator without model permissions), own agent (the agent of
node-a, which owns every object below), other agent (node-b's), router, and admin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.access.models import MachineCredential
from controlplane.deployments.models import AgentCommand
from controlplane.routers.models import RouterInstance

CALLERS = ("anonymous", "user", "own_agent", "other_agent", "router", "admin")


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    allowed: dict[str, int]  # caller -> expected success status; others get 401/403
    body: Any = None


def inventory_body() -> dict[str, Any]:
    return {
        "agent_version": "t",
        "cpu": {
            "model": "X",
            "architecture": "x86_64",
            "sockets": 1,
            "physical_cores": 4,
            "threads": 8,
        },
        "numa_nodes": [{"index": 0, "cpus": "0-7"}],
        "accelerators": [
            {
                "kind": "gpu",
                "index": 0,
                "uuid": "GPU-x",
                "simulated": True,
                "memory_total_bytes": 85899345920,
            }
        ],
    }


def cases(ids: dict[str, Any]) -> list[Case]:
    n, d, r, cmd = ids["node"], ids["deployment"], ids["router"], ids["command"]
    readers = {"user": 200, "admin": 200}
    node_readers = {**readers, "own_agent": 200}
    all_agents = {"own_agent": 200, "other_agent": 200}
    container_report = {
        "containers": [{"deployment_id": d, "generation": 0, "role": "gpu", "status": "running"}]
    }
    return [
        Case("GET", "/api/v1/health", {c: 200 for c in CALLERS}),
        Case("GET", "/api/v1/nodes/", {**readers, **all_agents}),
        Case("GET", f"/api/v1/nodes/{n}/", node_readers),
        Case("POST", "/api/v1/nodes/", {"admin": 201}, {"name": "node-new"}),
        Case("PATCH", f"/api/v1/nodes/{n}/", {"admin": 200}, {"labels": {"rack": "r1"}}),
        Case(
            "PUT",
            f"/api/v1/nodes/{n}/inventory",
            {"own_agent": 200, "admin": 200},
            inventory_body(),
        ),
        Case(
            "POST",
            f"/api/v1/nodes/{n}/heartbeat",
            {"own_agent": 200, "admin": 200},
            {"cpu_percent": 5},
        ),
        Case("GET", f"/api/v1/nodes/{n}/heartbeats", node_readers),
        Case("POST", f"/api/v1/nodes/{n}/agent-token", {"admin": 201}, {}),
        Case("GET", "/api/v1/accelerators/", {**readers, **all_agents}),
        Case("GET", "/api/v1/agent/self", all_agents),
        Case("GET", "/api/v1/credentials/", readers),
        Case("POST", "/api/v1/credentials/", {"admin": 201}, {"kind": "router", "name": "r9"}),
        Case("GET", "/api/v1/profiles/", readers),
        Case("POST", "/api/v1/profiles/", {"admin": 201}, {"name": "p-new", "model": "m"}),
        Case("GET", "/api/v1/deployments/", {**readers, **all_agents, "router": 200}),
        Case("GET", f"/api/v1/deployments/{d}/", {**node_readers, "router": 200}),
        Case("GET", f"/api/v1/deployments/{d}/events", {**node_readers, "router": 200}),
        Case("POST", f"/api/v1/deployments/{d}/stop", {"admin": 202}, {}),
        Case("GET", "/api/v1/containers/", {**readers, **all_agents}),
        Case(
            "PUT",
            f"/api/v1/nodes/{n}/containers",
            {"own_agent": 200, "admin": 200},
            container_report,
        ),
        Case("GET", "/api/v1/commands/", {**readers, **all_agents}),
        Case(
            "POST",
            f"/api/v1/commands/{cmd}/result",
            {"own_agent": 200, "admin": 200},
            {"status": "succeeded"},
        ),
        Case("GET", "/api/v1/policies/", {**readers, "router": 200}),
        Case("GET", "/api/v1/policies/default/", {**readers, "router": 200}),
        Case(
            "PATCH",
            "/api/v1/policies/default/",
            {"admin": 200},
            {"cpu_max_batch_size": 4, "reason": "matrix"},
        ),
        Case("GET", "/api/v1/policies/default/revisions", {**readers, "router": 200}),
        Case("GET", "/api/v1/routing/policies/default", {**readers, "router": 200}),
        Case("GET", "/api/v1/routing/deployments", {**readers, "router": 200}),
        Case("POST", "/api/v1/routers/register", {"router": 200}, {"name": "router-a"}),
        Case("POST", f"/api/v1/routers/{r}/stats", {"router": 200}, {"request_rate": 1.0}),
        Case("GET", "/api/v1/routers/", readers),
        Case("GET", "/api/v1/scenarios/", readers),
        Case(
            "POST",
            "/api/v1/scenarios/",
            {"admin": 201},
            {"name": "tiny", "input_tokens": 8, "output_tokens": 8},
        ),
        Case("GET", "/api/v1/benchmark-runs/", readers),
        Case("GET", "/api/v1/benchmark-runs/compare?ids=1", {"user": 400, "admin": 400}),
        Case("GET", "/api/v1/advisor?goal=latency", readers),
        Case("GET", "/api/v1/metrics", readers),
        Case("GET", "/api/v1/schema/", readers),
    ]


@pytest.fixture
def world(node, other_node, make_deployment, router_token) -> dict[str, Any]:
    deployment = make_deployment(node=node)
    credential = MachineCredential.objects.get(kind="router", name="router-a")
    router = RouterInstance.objects.create(name="router-a", credential=credential)
    command = AgentCommand.objects.create(
        node=node, deployment=deployment, action="start", role="gpu", step="start-gpu"
    )
    return {
        "node": node.pk,
        "deployment": deployment.pk,
        "router": router.pk,
        "command": command.dispatch_id,
    }


@pytest.fixture
def clients(
    anonymous_client, user_client, agent_client, other_agent_client, router_client, admin_client
) -> dict[str, APIClient]:
    return {
        "anonymous": anonymous_client,
        "user": user_client,
        "own_agent": agent_client,
        "other_agent": other_agent_client,
        "router": router_client,
        "admin": admin_client,
    }


def test_every_endpoint_answers_each_caller_as_the_matrix_says(world, clients) -> None:
    failures = []
    for case in cases(world):
        for caller in CALLERS:
            client = clients[caller]
            response = client.generic(
                case.method,
                case.path,
                data=None if case.body is None else __import__("json").dumps(case.body),
                content_type="application/json",
            )
            if caller in case.allowed:
                expected = case.allowed[caller]
            else:
                expected = 401 if caller == "anonymous" else 403
            if response.status_code != expected:
                failures.append(
                    f"{case.method} {case.path} as {caller}: expected {expected}, "
                    f"got {response.status_code} {response.content[:160]!r}"
                )
    assert not failures, "\n".join(failures)


def test_denials_use_the_json_error_shape(world, clients) -> None:
    response = clients["router"].get("/api/v1/nodes/")
    assert response.status_code == 403
    assert set(response.json()["error"]) >= {"code", "message"}
    response = clients["anonymous"].get("/api/v1/nodes/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"


def test_lists_show_an_agent_only_its_own_node(world, clients, make_deployment, other_node) -> None:
    make_deployment(node=other_node)
    nodes = clients["own_agent"].get("/api/v1/nodes/").json()["results"]
    assert [n["name"] for n in nodes] == ["node-a"]
    deployments = clients["other_agent"].get("/api/v1/deployments/").json()["results"]
    assert {d["node"] for d in deployments} == {other_node.pk}


def test_a_revoked_or_unknown_token_is_401(world, agent_token) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer sxa_not-a-real-token")
    assert client.get("/api/v1/agent/self").status_code == 401
    MachineCredential.objects.get(kind="agent", name="agent-a").revoke()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {agent_token}")
    response = client.get("/api/v1/agent/self")
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]


def test_an_operator_with_model_permissions_may_write(world, operator_client) -> None:
    response = operator_client.patch(
        "/api/v1/policies/default/", {"mode": "gpu-only", "reason": "maintenance"}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["mode"] == "gpu-only"
