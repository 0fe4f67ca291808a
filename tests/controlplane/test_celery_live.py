"""A real Celery worker on the configured broker (Redis on CI, the filesystem broker on the
embedded defaults) drives the deploy workflow, and the node's agent fetches each command with
its own token."""

from __future__ import annotations

import uuid

import pytest
from django.db import connections
from rest_framework.test import APIClient

from controlplane.access.models import MachineCredential
from controlplane.deployments import services
from controlplane.deployments.models import AgentCommand, Deployment
from tests.support.controlplane import running, syshax, wait_until


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_worker_advances_a_deploy_and_the_agent_fetches_its_commands(
    tmp_path, make_node, make_profile, admin_user
) -> None:
    # A fresh name, so the node's queue holds nothing from an earlier run.
    node = make_node(f"live-{uuid.uuid4().hex[:8]}")
    deployment = services.create_deployment(
        name="live", profile=make_profile(), node=node, acting_user=admin_user
    )
    _, token = MachineCredential.issue("agent", f"agent-{node.name}", node=node)
    connections.close_all()
    with running(syshax("worker", "--concurrency", "1"), tmp_path / "worker.log"):
        services.request_deploy(deployment, acting_user=admin_user)

        def first_command() -> AgentCommand | None:
            return AgentCommand.objects.filter(deployment=deployment).first()

        command = wait_until(first_command, 60, "the worker to dispatch the first step")
        assert command.step == "stop-old-cpu"
        agent = APIClient()
        agent.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        answer = agent.get("/api/v1/agent/commands", {"session": "s1", "wait": "5"})
        assert answer.status_code == 200, answer.content
        (message,) = answer.json()["commands"]
        assert message["dispatch_id"] == str(command.dispatch_id)
        assert (message["action"], message["node"], message["attempt"]) == ("stop", node.name, 1)

        from controlplane.deployments.workflow import record_command_result

        record_command_result(command, status="succeeded", detail="", output={})
        wait_until(
            lambda: AgentCommand.objects.filter(
                deployment=deployment, step="stop-old-gpu"
            ).exists(),
            60,
            "the worker to move to the next step after the agent's result",
        )
    log = (tmp_path / "worker.log").read_text()
    assert "deployments.advance" in log
    assert Deployment.objects.get(pk=deployment.pk).state == "deploying"
