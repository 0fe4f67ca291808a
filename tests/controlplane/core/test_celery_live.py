"""A real Celery worker on the configured broker (Redis on CI, the filesystem broker on the
embedded defaults) drives the deploy workflow, and the node's agent fetches each command with
its own token."""

from __future__ import annotations

import uuid

import pytest
from django.db import connections
from rest_framework.test import APIClient

from controlplane.access.models import MachineCredential
from controlplane.benchmarks.models import BenchmarkRun, Scenario
from controlplane.benchmarks.services import create_run
from controlplane.deployments import services
from controlplane.deployments.models import AgentCommand, Deployment
from tests.support.controlplane import running, syshax, wait_until


@pytest.mark.process
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


@pytest.mark.process
@pytest.mark.django_db(transaction=True)
def test_benchmark_runs_wait_for_their_own_worker_and_never_hold_up_a_deploy(
    tmp_path, make_node, make_profile, admin_user
) -> None:
    node = make_node(f"live-{uuid.uuid4().hex[:8]}")
    deployment = services.create_deployment(
        name="live-bench", profile=make_profile(), node=node, acting_user=admin_user
    )
    # transaction=True empties the tables between tests, the seeded scenarios with them.
    short, _ = Scenario.objects.get_or_create(
        name="live-short", defaults={"input_tokens": 8, "output_tokens": 4}
    )
    runs = [
        create_run(
            acting_user=admin_user,
            name=f"queued {i}",
            scenario=short,
            deployment=deployment,
            mode="gpu",
            concurrency=[1],
            iterations=2,
        )
        for i in range(3)
    ]
    connections.close_all()
    # The deploy worker (the default queues) takes the deploy and leaves the runs alone, though
    # there are more of them than it has slots.
    with running(syshax("worker", "--concurrency", "1"), tmp_path / "worker.log"):
        services.request_deploy(deployment, acting_user=admin_user)
        wait_until(
            lambda: AgentCommand.objects.filter(deployment=deployment).exists(),
            60,
            "the deploy worker to dispatch the first step with three runs queued",
        )
        statuses = set(
            BenchmarkRun.objects.filter(pk__in=[r.pk for r in runs]).values_list(
                "status", flat=True
            )
        )
        assert statuses == {"queued"}
    # (The worker lists every task it knows at start; one it received is logged as NAME[id].)
    assert "benchmarks.execute_run[" not in (tmp_path / "worker.log").read_text()
    # The benchmarks worker takes them (the deployment runs nothing, so they end quickly).
    bench = syshax("worker", "--queues", "benchmarks", "--concurrency", "1")
    with running(bench, tmp_path / "benchmarks.log"):
        wait_until(
            lambda: (
                not BenchmarkRun.objects.filter(
                    pk__in=[r.pk for r in runs], status="queued"
                ).exists()
            ),
            120,
            "the benchmarks worker to take the queued runs",
        )
    assert "benchmarks.execute_run[" in (tmp_path / "benchmarks.log").read_text()
