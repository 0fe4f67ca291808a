"""Agents fetch their commands over the API with their own token, and reach nothing else.

These are the reproductions of the attacker with one agent token: another node's commands
unreadable, no command can be forged or a task injected (no broker credential ever reaches an
agent), and a revoked token cut off at its next request.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from controlplane.access.models import MachineCredential
from controlplane.deployments import delivery, workflow
from controlplane.deployments.models import AgentCommand
from controlplane.deployments.workflow import advance


def issue(node, action: str = "stop", **fields) -> AgentCommand:
    return AgentCommand.objects.create(
        node=node, action=action, role="gpu", spec={"deployment_id": 1}, **fields
    )


def fetch(client, session: str = "s1", wait: str = "0"):
    return client.get("/api/v1/agent/commands", {"session": session, "wait": wait})


def test_an_agent_is_handed_its_own_nodes_commands_once_per_session(
    node, other_node, agent_client
) -> None:
    mine = issue(node)
    issue(other_node)
    body = fetch(agent_client).json()
    (message,) = body["commands"]
    assert message["dispatch_id"] == str(mine.dispatch_id)
    assert (message["node"], message["action"], message["attempt"]) == ("node-a", "stop", 1)
    assert message["spec"] == {"deployment_id": 1}
    assert fetch(agent_client).json() == {"commands": []}  # the same session: once
    # A restarted agent is a new session: what it had not answered is handed to it again.
    (again,) = fetch(agent_client, session="s2").json()["commands"]
    assert again["dispatch_id"] == str(mine.dispatch_id) and again["attempt"] == 2
    mine.refresh_from_db()
    assert mine.delivered_to == "s2" and mine.delivered_at is not None


def test_an_answered_command_is_not_handed_out_again(node, agent_client) -> None:
    command = issue(node)
    fetch(agent_client)
    answer = agent_client.post(
        f"/api/v1/commands/{command.dispatch_id}/result", {"status": "succeeded"}, format="json"
    )
    assert answer.status_code == 200
    assert fetch(agent_client, session="s2").json() == {"commands": []}


def test_another_nodes_commands_are_out_of_reach(node, other_node, agent_client) -> None:
    theirs = issue(other_node)
    assert fetch(agent_client).json() == {"commands": []}
    listed = agent_client.get("/api/v1/commands/", {"node": other_node.pk}).json()
    assert listed["count"] == 0
    assert agent_client.get(f"/api/v1/commands/{theirs.dispatch_id}/").status_code == 403
    result = agent_client.post(
        f"/api/v1/commands/{theirs.dispatch_id}/result", {"status": "failed"}, format="json"
    )
    assert result.status_code == 403
    theirs.refresh_from_db()
    assert theirs.status == "queued" and theirs.attempts == 0


def test_no_agent_can_issue_a_command(node, agent_client) -> None:
    forged = {"node": node.pk, "action": "start", "role": "gpu", "spec": {"command": ["sh"]}}
    assert agent_client.post("/api/v1/commands/", forged, format="json").status_code in (403, 405)
    assert not AgentCommand.objects.exists()


def test_no_broker_credential_reaches_an_agent(node, agent_client, settings) -> None:
    settings.CELERY_BROKER_URL = "redis://:s3cret-broker-password@127.0.0.1:6379/0"
    issue(node)
    seen = [
        agent_client.get("/api/v1/agent/self").json(),
        fetch(agent_client).json(),
        agent_client.get(f"/api/v1/nodes/{node.pk}/").json(),
        agent_client.get("/api/v1/commands/").json(),
    ]
    text = json.dumps(seen)
    assert "s3cret" not in text and "redis://" not in text and "broker" not in text
    assert seen[0]["command_wait_seconds"] == settings.AGENT_COMMAND_WAIT_SECONDS


def test_a_revoked_token_is_refused_at_its_next_fetch(node, agent_client, agent_token) -> None:
    issue(node)
    assert fetch(agent_client).status_code == 200
    MachineCredential.objects.get(node=node).revoke()
    refused = fetch(agent_client, session="s2")
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "machine token revoked"
    assert AgentCommand.objects.get().attempts == 1  # nothing handed out after the revocation


def test_only_agent_tokens_fetch_commands(router_client, admin_client) -> None:
    assert fetch(router_client).status_code == 403
    assert fetch(admin_client).status_code == 403


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({}, "session"),
        ({"session": "a b"}, "session"),
        ({"session": "x" * 65}, "session"),
        ({"session": "s", "wait": "-1"}, "wait"),
        ({"session": "s", "wait": "61"}, "wait"),
        ({"session": "s", "wait": "soon"}, "wait"),
    ],
)
def test_a_bad_fetch_names_its_field(agent_client, query, field) -> None:
    answer = agent_client.get("/api/v1/agent/commands", query)
    assert answer.status_code == 400
    assert field in answer.json()["error"]["fields"]


@pytest.mark.django_db(transaction=True)
def test_a_waiting_fetch_answers_as_soon_as_a_command_is_issued(make_node) -> None:
    node = make_node("node-wait")

    def issue_later() -> None:
        time.sleep(0.6)
        issue(node)
        delivery.wake(node.pk)
        connections.close_all()

    threading.Thread(target=issue_later).start()
    began = time.monotonic()
    commands = delivery.fetch(node.pk, "s1", wait_seconds=15)
    took = time.monotonic() - began
    assert len(commands) == 1
    # Woken, not timed out (Redis wakes it at once; the embedded defaults poll twice a second).
    assert 0.5 < took < 5, took
    began = time.monotonic()
    assert delivery.fetch(node.pk, "s1", wait_seconds=0.6) == []
    assert time.monotonic() - began >= 0.6


def test_the_workflow_issues_rows_and_wakes_no_broker(make_deployment, node) -> None:
    deployment = make_deployment(node=node, state="deploying", desired_state="running")
    advance(deployment.pk)
    command = AgentCommand.objects.get(deployment=deployment)
    assert command.step == "stop-old-cpu" and command.attempts == 0
    assert command.delivered_at is None


def test_stale_commands_are_offered_again_then_expire(node, agent_client) -> None:
    old = timezone.now() - timedelta(seconds=500)
    never_fetched = issue(node)
    AgentCommand.objects.filter(pk=never_fetched.pk).update(created_at=old)
    fetched = issue(node, action="inspect")
    fetch(agent_client)  # hands out both
    AgentCommand.objects.filter(pk=never_fetched.pk).update(delivered_at=None, attempts=0)
    AgentCommand.objects.filter(pk=fetched.pk).update(delivered_at=old)

    assert workflow.expire_stale_commands(older_than_seconds=60, max_attempts=2) == 2
    never_fetched.refresh_from_db()
    assert never_fetched.status == "expired"
    assert "did not fetch the command within 120 s" in never_fetched.detail
    fetched.refresh_from_db()
    assert fetched.status == "queued" and fetched.delivered_to == ""
    (again,) = fetch(agent_client).json()["commands"]  # offered again, even to the same session
    assert again["dispatch_id"] == str(fetched.dispatch_id) and again["attempt"] == 2

    AgentCommand.objects.filter(pk=fetched.pk).update(delivered_at=old)
    assert workflow.expire_stale_commands(older_than_seconds=60, max_attempts=2) == 1
    fetched.refresh_from_db()
    assert fetched.status == "expired"
    assert "no result from the agent of node node-a after 2 deliveries" in fetched.detail


@pytest.mark.django_db(transaction=True)
def test_a_token_revoked_during_its_long_poll_is_handed_nothing(make_node) -> None:
    from tests.controlplane.conftest import _client_with_bearer

    node = make_node("node-revoked")
    credential, token = MachineCredential.issue("agent", "agent-revoked", node=node)

    def revoke_then_issue() -> None:
        time.sleep(0.5)
        credential.revoke()
        issue(node)
        delivery.wake(node.pk)
        connections.close_all()

    threading.Thread(target=revoke_then_issue).start()
    answer = fetch(_client_with_bearer(token), wait="5")
    assert answer.status_code == 200 and answer.json() == {"commands": []}
    assert AgentCommand.objects.get(node=node).attempts == 0


def test_a_repeated_result_queues_the_workflow_again(
    make_deployment, node, agent_client, django_capture_on_commit_callbacks
) -> None:
    deployment = make_deployment(node=node, state="deploying", desired_state="running")
    command = issue(node, deployment=deployment)
    url = f"/api/v1/commands/{command.dispatch_id}/result"
    with django_capture_on_commit_callbacks() as first:
        assert agent_client.post(url, {"status": "succeeded"}, format="json").json() == {
            "accepted": True,
            "duplicate": False,
        }
    # The agent repeats a result when its first answer was an error (the broker down when
    # the workflow's next step was queued): the repeat queues that step again.
    with django_capture_on_commit_callbacks() as again:
        answer = agent_client.post(url, {"status": "succeeded"}, format="json").json()
    assert answer == {"accepted": True, "duplicate": True}
    assert len(first) == len(again) == 1
