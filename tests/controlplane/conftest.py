"""Factories (one object each) and API clients for every kind of caller."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from controlplane.access.models import MachineCredential
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.inventory.models import Accelerator, CpuTopology, Node, NumaNode
from controlplane.policy.services import ensure_default_policy

_seq = itertools.count(1)
GIB = 1024**3


@pytest.fixture
def make_node(db: Any):
    def make(
        name: str | None = None,
        *,
        accelerators: int = 1,
        accel_gb: int = 80,
        numa: int = 2,
        cores_per_numa: int = 4,
        **fields: Any,
    ) -> Node:
        node = Node.objects.create(name=name or f"node-{next(_seq)}", address="127.0.0.1", **fields)
        CpuTopology.objects.create(
            node=node,
            model_name="Test CPU",
            architecture="x86_64",
            sockets=1,
            physical_cores=numa * cores_per_numa,
            threads=numa * cores_per_numa,
            isa_flags=["avx2"],
            memory_total_bytes=64 * GIB,
        )
        for index in range(numa):
            first = index * cores_per_numa
            NumaNode.objects.create(
                node=node,
                index=index,
                cpus=f"{first}-{first + cores_per_numa - 1}",
                memory_total_bytes=32 * GIB,
            )
        for index in range(accelerators):
            Accelerator.objects.create(
                node=node,
                kind="gpu",
                vendor="NVIDIA",
                model_name="A100-SXM4-80GB",
                index=index,
                uuid=f"GPU-{node.name}-{index}",
                memory_total_bytes=accel_gb * GIB,
                simulated=True,
            )
        return node

    return make


@pytest.fixture
def make_profile(db: Any):
    def make(**fields: Any) -> DeploymentProfile:
        defaults: dict[str, Any] = {
            "name": f"profile-{next(_seq)}",
            "model": "deepseek-r1-distill-qwen-32b",
            "engine": "simulator",
            "quantization": "q4_0",
        }
        return DeploymentProfile.objects.create(**{**defaults, **fields})

    return make


@pytest.fixture
def make_deployment(db: Any, make_node, make_profile):
    def make(**fields: Any) -> Deployment:
        node = fields.pop("node", None) or make_node()
        profile = fields.pop("profile", None) or make_profile()
        return Deployment.objects.create(
            name=fields.pop("name", f"dep-{next(_seq)}"),
            node=node,
            profile=profile,
            policy=ensure_default_policy(),
            **fields,
        )

    return make


@pytest.fixture
def node(make_node) -> Node:
    return make_node("node-a")


@pytest.fixture
def other_node(make_node) -> Node:
    return make_node("node-b")


def _client_with_bearer(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def anonymous_client() -> APIClient:
    return APIClient()


@pytest.fixture
def user_client(db: Any) -> APIClient:
    """An operator who may read but holds no model permissions."""
    user = User.objects.create_user("viewer", password="x-unused-x")
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def admin_user(db: Any) -> User:
    return User.objects.create_superuser("root", "root@example.com", "x-unused-x")


@pytest.fixture
def admin_client(admin_user: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(admin_user)
    return client


@pytest.fixture
def operator_client(db: Any) -> APIClient:
    """A non-superuser granted permissions through the normal Django mechanism."""
    user = User.objects.create_user("operator", password="x-unused-x")
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label__in=[
                "inventory",
                "deployments",
                "policy",
                "benchmarks",
                "access",
                "routers",
            ]
        )
    )
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def agent_token(node: Node) -> str:
    return MachineCredential.issue("agent", "agent-a", node=node)[1]


@pytest.fixture
def agent_client(agent_token: str) -> APIClient:
    return _client_with_bearer(agent_token)


@pytest.fixture
def other_agent_client(other_node: Node) -> APIClient:
    return _client_with_bearer(MachineCredential.issue("agent", "agent-b", node=other_node)[1])


@pytest.fixture
def router_token(db: Any) -> str:
    return MachineCredential.issue("router", "router-a")[1]


@pytest.fixture
def router_client(router_token: str) -> APIClient:
    return _client_with_bearer(router_token)
