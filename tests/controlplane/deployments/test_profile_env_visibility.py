"""A profile's env values (where HF_TOKEN sits) reach only people who may change profiles, and
the agent that runs the engines.

The reproduction: the values were hidden on ``profiles/`` but every signed-in person read
them in the spec of each start command (``commands/`` and the admin's command pages).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from controlplane.access.models import MachineCredential, PersonalToken
from controlplane.core.models import AuditEntry
from controlplane.deployments import services, workflow
from controlplane.deployments.models import AgentCommand, Deployment
from testbed.factories import build_node
from tests.support.gateway import Running, serving_gateway

SECRET = "hf_never_for_viewers_0123"
APPS = ["inventory", "deployments", "policy", "benchmarks", "routers", "core", "access"]


def _staff(name: str, *codenames: str) -> Client:
    """A staff member who may view everything and change only ``codenames``."""
    user = User.objects.create_user(name, password="x-unused-x", is_staff=True)
    views = Permission.objects.filter(
        content_type__app_label__in=APPS, codename__startswith="view_"
    )
    user.user_permissions.set([*views, *Permission.objects.filter(codename__in=codenames)])
    client = Client()
    client.force_login(user)
    return client


def _fetch(agent_client) -> list[dict[str, Any]]:
    answer = agent_client.get("/api/v1/agent/commands", {"session": "s1", "wait": "0"})
    assert answer.status_code == 200
    return answer.json()["commands"]


@pytest.fixture
def deployed(node, agent_client, make_profile) -> tuple[Deployment, list[dict[str, Any]]]:
    """A deployment of a profile with a token, run to ``running`` by its agent; with every
    command message the agent was handed."""
    profile = make_profile(
        gpu_env={"HF_TOKEN": SECRET}, cpu_env={"HF_TOKEN": SECRET, "HF_HOME": "/cache"}
    )
    deployment = services.create_deployment(
        name="dep-token", profile=profile, node=node, acting_user="test", start=True
    )
    handed: list[dict[str, Any]] = []
    for _ in range(6):
        workflow.advance(deployment.pk)
        for message in _fetch(agent_client):
            handed.append(message)
            answer = agent_client.post(
                f"/api/v1/commands/{message['dispatch_id']}/result",
                {"status": "succeeded"},
                format="json",
            )
            assert answer.status_code == 200
    deployment.refresh_from_db()
    assert deployment.state == "running"
    return deployment, handed


def _pages(deployment: Deployment) -> list[str]:
    """Every page and answer a signed-in person reads a command, deployment or profile on."""
    profile = deployment.profile
    commands = list(AgentCommand.objects.filter(deployment=deployment))
    return [
        "/api/v1/commands/",
        *(f"/api/v1/commands/{c.pk}/" for c in commands),
        "/api/v1/deployments/",
        f"/api/v1/deployments/{deployment.pk}/",
        f"/api/v1/deployments/{deployment.pk}/events/",
        "/api/v1/containers/",
        "/api/v1/profiles/",
        f"/api/v1/profiles/{profile.pk}/",
        "/deployments/",
        f"/deployments/{deployment.pk}/",
        f"/deployments/{deployment.pk}/timeline.json",
        f"/profiles/{profile.name}/",
        f"/nodes/{deployment.node.name}/",
        "/admin/deployments/agentcommand/",
        *(f"/admin/deployments/agentcommand/{c.pk}/change/" for c in commands),
        f"/admin/deployments/deploymentprofile/{profile.pk}/change/",
        f"/admin/deployments/deployment/{deployment.pk}/change/",
        "/admin/deployments/deploymentevent/",
        "/admin/core/auditentry/",
        *(f"/admin/core/auditentry/{a.pk}/change/" for a in AuditEntry.objects.all()),
    ]


def test_only_a_person_who_may_change_profiles_reads_env_values_anywhere(deployed) -> None:
    deployment, _ = deployed
    viewer = _staff("viewer")
    for page in _pages(deployment):
        answer = viewer.get(page)
        assert answer.status_code == 200, page
        assert SECRET not in answer.content.decode(), page
    start_gpu = AgentCommand.objects.get(deployment=deployment, step="start-gpu")
    spec = viewer.get(f"/api/v1/commands/{start_gpu.pk}/").json()["spec"]
    assert spec["env"] == {"HF_TOKEN": "<hidden>"}  # the names stay, for debugging
    start_cpu = AgentCommand.objects.get(deployment=deployment, step="start-cpu")
    env = viewer.get(f"/api/v1/commands/{start_cpu.pk}/").json()["spec"]["env"]
    assert env["HF_TOKEN"] == "<hidden>" and set(env.values()) == {"<hidden>"}
    admin_page = viewer.get(f"/admin/deployments/agentcommand/{start_gpu.pk}/change/")
    assert "&lt;hidden&gt;" in admin_page.content.decode()
    # One who may change profiles reads them where a viewer reads the names.
    editor = _staff("editor", "change_deploymentprofile")
    spec = editor.get(f"/api/v1/commands/{start_gpu.pk}/").json()["spec"]
    assert spec["env"] == {"HF_TOKEN": SECRET}
    for page in (
        f"/admin/deployments/agentcommand/{start_gpu.pk}/change/",
        f"/admin/deployments/deploymentprofile/{deployment.profile.pk}/change/",
    ):
        assert SECRET in editor.get(page).content.decode(), page


def test_the_agent_is_handed_the_real_values_and_reads_no_others(
    deployed, agent_client, node
) -> None:
    _, handed = deployed
    starts = {m["spec"]["role"]: m["spec"]["env"] for m in handed if m["action"] == "start"}
    assert starts["gpu"] == {"HF_TOKEN": SECRET}
    assert starts["cpu"]["HF_TOKEN"] == SECRET and starts["cpu"]["HF_HOME"] == "/cache"
    # Its read of the command list is a reader's, not its fetch: hidden there too.
    listed = agent_client.get("/api/v1/commands/", {"node": node.pk})
    assert listed.status_code == 200 and SECRET not in listed.content.decode()


def test_a_view_only_admin_sees_the_profile_env_names_not_values(make_profile) -> None:
    profile = make_profile(gpu_env={"HF_TOKEN": SECRET}, cpu_env={"OTHER": SECRET})
    viewer = _staff("viewer")
    page = viewer.get(f"/admin/deployments/deploymentprofile/{profile.pk}/change/")
    text = page.content.decode()
    assert page.status_code == 200
    assert SECRET not in text and "HF_TOKEN" in text and "OTHER" in text
    # One who may add profiles but not change them still gets the env fields on the add form.
    adder = _staff("adder", "add_deploymentprofile")
    form = adder.get("/admin/deployments/deploymentprofile/add/").content.decode()
    assert 'name="gpu_env"' in form and 'name="cpu_env"' in form


@pytest.fixture
def gateway(live_server: Any) -> Iterator[Running]:
    with serving_gateway(live_server.url, credential_ttl=0.0) as running:
        yield running


@pytest.mark.django_db(transaction=True)
def test_through_the_machine_gateway_the_agent_gets_the_values_and_a_person_does_not(
    gateway: Running,
) -> None:
    running = gateway
    node = build_node("node-gw")
    token = MachineCredential.issue("agent", "agent-gw", node=node)[1]
    agent = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30)
    command = AgentCommand.objects.create(
        node=node, action="start", role="gpu", spec={"env": {"HF_TOKEN": SECRET}}
    )
    fetched = agent.get(
        f"{running.url}/api/v1/agent/commands", params={"session": "s1", "wait": "5"}
    )
    assert fetched.status_code == 200
    assert [m["spec"]["env"] for m in fetched.json()["commands"]] == [{"HF_TOKEN": SECRET}]
    viewer = User.objects.create_user("viewer", password="x-unused-x")
    key = PersonalToken.issue(viewer, "read")[1]
    person = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30)
    read = person.get(f"{running.url}/api/v1/commands/{command.pk}/")
    assert read.status_code == 200 and read.json()["spec"]["env"] == {"HF_TOKEN": "<hidden>"}
