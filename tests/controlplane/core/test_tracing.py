"""The control plane's own traces (docs/tracing.md, "The control plane's work"): a deploy is
one trace from the API call, through the workflow's Celery tasks, to the agent's span for
each command it handled and back, the trace continuing a caller's ``traceparent``; with
tracing off the command carries no context and nothing is loaded."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.handlers.wsgi import WSGIHandler

from agents.main import Agent, AgentConfig
from controlplane.core import tracing
from controlplane.deployments.models import AgentCommand, Deployment, DeploymentEvent
from tests.support.otlp import Collector, Span

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Engines:
    """The agent's executor, standing in for the runtime: every command succeeds."""

    def execute(self, **command: Any) -> dict[str, Any]:
        return {"status": "succeeded", "detail": "", "containers": []}

    def all_container_states(self) -> list[dict[str, Any]]:
        return []


@pytest.fixture
def collector() -> Iterator[Collector]:
    receiver = Collector()
    yield receiver
    receiver.close()


@pytest.fixture
def traced(settings: Any, collector: Collector) -> Iterator[Collector]:
    """The control plane tracing to the collector, its tasks run eagerly (in the caller)."""
    settings.TRACES_ENDPOINT = collector.url
    settings.CELERY_TASK_ALWAYS_EAGER = True
    tracing.start()
    yield collector
    tracing.stop()


def _agent(node: Any, token: str, state_dir: Path, endpoint: str) -> Agent:
    """The real agent, its HTTP client answered in-process by the control plane's WSGI app."""
    config = AgentConfig(
        control_plane="http://testserver",
        token=token,
        state_dir=state_dir,
        otlp_traces_endpoint=endpoint,
        engine_pythons=[sys.executable],
    )
    agent = Agent(config, runtime=object())  # type: ignore[arg-type]
    agent.client.http = httpx.Client(
        transport=httpx.WSGITransport(app=WSGIHandler()),
        base_url="http://testserver/api/v1/",
        headers={"Authorization": f"Bearer {token}"},
    )
    agent.node_id, agent.node_name = node.pk, node.name
    agent.executor = Engines()  # type: ignore[assignment]
    return agent


def _run_agent(agent: Agent) -> int:
    """Handle commands until none is left; how many were handled."""
    handled = 0
    while commands := agent.client.fetch_commands(agent.session, 0):
        for message in commands:
            agent.handle_command(**message)
            handled += 1
    return handled


def _by_id(spans: list[Span]) -> dict[str, Span]:
    return {s.span_id: s for s in spans}


@pytest.mark.django_db(transaction=True)
def test_a_deploy_is_one_trace_from_the_api_through_the_tasks_to_the_agent_and_back(
    traced: Collector,
    admin_client: Any,
    make_deployment: Any,
    agent_token: str,
    node: Any,
    tmp_path: Path,
) -> None:
    deployment = make_deployment(node=node)
    answer = admin_client.post(
        f"/api/v1/deployments/{deployment.pk}/deploy/",
        HTTP_TRACEPARENT=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    )
    assert answer.status_code in (200, 202), answer.content
    # The command the workflow wrote carries the context of the task that wrote it.
    first = AgentCommand.objects.get(deployment=deployment, step="stop-old-cpu")
    assert first.traceparent.startswith(f"00-{CLIENT_TRACE}-")

    agent = _agent(node, agent_token, tmp_path / "agent", traced.url)
    assert _run_agent(agent) == 4  # stop old CPU and GPU, start GPU, start CPU
    deployment.refresh_from_db()
    assert deployment.state == "running"
    assert tracing._started is not None
    tracing._started.provider.force_flush()
    agent.tracing.shutdown()

    spans = traced.trace(CLIENT_TRACE)
    by_id = _by_id(spans)
    services = {s.service for s in spans}
    assert services == {"syshax-controlplane", "syshax-agent"}
    # The API call continues the caller's span.
    (api,) = [s for s in spans if s.parent_id == CLIENT_SPAN]
    assert api.service == "syshax-controlplane" and "deploy" in api.name
    # Every workflow step is a Celery task's span, the first one under the API call.
    advances = [s for s in spans if s.name == "run/deployments.advance"]
    assert len(advances) == 5  # the deploy, then one per command's result
    assert any(by_id.get(s.parent_id) == api for s in advances)
    assert all(s.attributes["syshax.deployment"] == deployment.name for s in advances)
    # Each command the agent handled is a span under the task that issued it ...
    commands = [s for s in spans if s.service == "syshax-agent"]
    assert (
        sorted(s.name for s in commands) == ["agent command start"] * 2 + ["agent command stop"] * 2
    )
    for span in commands:
        assert by_id[span.parent_id].name == "run/deployments.advance"
        assert span.attributes["syshax.command.status"] == "succeeded"
        assert span.attributes["syshax.deployment_id"] == deployment.pk
    # ... and the control plane's handling of its result is under the agent's span, its next
    # step under that.
    results = [s for s in spans if s.parent_id in {c.span_id for c in commands}]
    assert len(results) == 4 and all("result" in s.name for s in results)
    assert {by_id[s.parent_id].service for s in advances if s.parent_id != api.span_id} == {
        "syshax-controlplane"
    }
    # The deployment's timeline names the trace; the dashboard links it when a viewer is set.
    events = DeploymentEvent.objects.filter(deployment=deployment)
    assert {e.detail.get("trace_id") for e in events} == {CLIENT_TRACE}


@pytest.mark.django_db
def test_with_tracing_off_a_command_carries_no_context(
    settings: Any,
    admin_client: Any,
    make_deployment: Any,
    agent_client: Any,
    node: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.CELERY_TASK_ALWAYS_EAGER = True
    assert not tracing.enabled()
    deployment = make_deployment(node=node)
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(f"/api/v1/deployments/{deployment.pk}/deploy/")
    (message,) = agent_client.get("/api/v1/agent/commands", {"session": "s", "wait": "0"}).json()[
        "commands"
    ]
    assert "traceparent" not in message
    assert "trace_id" not in DeploymentEvent.objects.filter(deployment=deployment).last().detail
    assert Deployment.objects.get(pk=deployment.pk).state == "deploying"


def test_the_dashboard_links_a_trace_id_through_the_url_template(settings: Any) -> None:
    settings.TRACE_URL_TEMPLATE = "http://jaeger:16686/trace/{trace_id}"
    assert tracing.trace_url(CLIENT_TRACE) == f"http://jaeger:16686/trace/{CLIENT_TRACE}"
    assert tracing.trace_url("") == ""
    settings.TRACE_URL_TEMPLATE = ""
    assert tracing.trace_url(CLIENT_TRACE) == ""
