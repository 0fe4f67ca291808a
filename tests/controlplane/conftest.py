"""Factories (one object each) and API clients for every kind of caller."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from controlplane.access.models import MachineCredential
from controlplane.deployments.models import Deployment
from controlplane.inventory.models import Node
from testbed.factories import build_deployment, build_node, build_profile


@pytest.fixture
def make_node(db: Any):
    return build_node


@pytest.fixture
def make_profile(db: Any):
    return build_profile


@pytest.fixture
def make_deployment(db: Any):
    def make(**fields: Any) -> Deployment:
        node = fields.pop("node", None) or build_node()
        profile = fields.pop("profile", None) or build_profile()
        return build_deployment(node, profile, **fields)

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


@pytest.fixture(autouse=True)
def _fresh_throttle_counts() -> None:
    """Each test starts with no request counted against any machine credential (a pk can come
    back in the next test on SQLite)."""
    from django.core.cache import cache

    cache.clear()


@pytest.fixture(autouse=True)
def _loopback_benchmark_targets(settings) -> None:
    """The tests benchmark engines they start on this host's loopback, on any port."""
    settings.BENCHMARK_ALLOWED_TARGETS = ["127.0.0.1", "localhost"]


@pytest.fixture(autouse=True)
def _short_command_fetch_wait(settings) -> None:
    """An agent's command fetch waits at most a second here (20 s by default), so a test or
    the API fuzzer calling it with an agent token is not held."""
    settings.AGENT_COMMAND_WAIT_SECONDS = 1.0


@pytest.fixture(autouse=True)
def _reaper_has_been_listening(db: Any) -> None:
    """The offline reaper judges nodes only once the control plane has been up to hear them
    for a grace period; here it has been, for an hour (test_inventory tests the rule)."""
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.core.models import Clock

    now = timezone.now()
    Clock.objects.update_or_create(name="reaper-ran", defaults={"at": now})
    Clock.objects.update_or_create(name="reaper-resumed", defaults={"at": now - timedelta(hours=1)})
