"""A real Celery worker on the configured broker (Redis on CI, the filesystem broker on the
embedded defaults) drives the deploy workflow, and commands reach the node's own queue."""

from __future__ import annotations

import uuid

import pytest
from django.db import connections

from controlplane.celery import app
from controlplane.deployments import services
from controlplane.deployments.models import AgentCommand, Deployment
from controlplane.deployments.workflow import AGENT_TASK
from tests.support.controlplane import running, syshax, wait_until


def take_from_queue(queue: str, timeout: float) -> dict:
    """Consume one message from a node's queue, as the node's agent would."""
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue)
        try:
            message = simple.get(block=True, timeout=timeout)
            message.ack()
            return {"headers": message.headers, "body": message.payload}
        finally:
            simple.close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_worker_advances_a_deploy_and_commands_reach_the_node_queue(
    tmp_path, make_node, make_profile, admin_user
) -> None:
    # A fresh name, so the node's queue holds nothing from an earlier run.
    node = make_node(f"live-{uuid.uuid4().hex[:8]}")
    deployment = services.create_deployment(
        name="live", profile=make_profile(), node=node, acting_user=admin_user
    )
    connections.close_all()
    with running(syshax("worker", "--concurrency", "1"), tmp_path / "worker.log"):
        services.request_deploy(deployment, acting_user=admin_user)

        def first_command() -> AgentCommand | None:
            return AgentCommand.objects.filter(deployment=deployment).first()

        command = wait_until(first_command, 60, "the worker to dispatch the first step")
        assert command.step == "stop-old-cpu"
        message = take_from_queue(node.command_queue, timeout=30)
        assert message["headers"]["task"] == AGENT_TASK
        _args, kwargs, _ = message["body"]
        assert kwargs["dispatch_id"] == str(command.dispatch_id)
        assert kwargs["action"] == "stop"

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
