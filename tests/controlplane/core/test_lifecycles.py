"""The state tables are enforced, the documented table is the enforced one, and every change
an operator or a machine makes leaves an audit row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controlplane.access.models import MachineCredential
from controlplane.benchmarks.choices import RUN_LIFECYCLE, RunStatus
from controlplane.benchmarks.models import BenchmarkRun, Scenario
from controlplane.benchmarks.runner import _finish
from controlplane.core.lifecycle import Lifecycle, TransitionError
from controlplane.core.models import AuditEntry
from controlplane.deployments import services, workflow
from controlplane.deployments.choices import (
    COMMAND_LIFECYCLE,
    DEPLOYMENT_LIFECYCLE,
    CommandStatus,
    DeploymentState,
)
from controlplane.deployments.models import AgentCommand, ContainerInstance
from controlplane.inventory.choices import NODE_LIFECYCLE, NodeStatus

DOC = Path(__file__).resolve().parents[3] / "docs" / "lifecycles.md"
STATES = [s.value for s in DeploymentState]


def documented_deployment_table() -> dict[str, set[str]]:
    text = DOC.read_text().split("## Deployment", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in STATES:
            named = re.sub(r"\([^)]*\)", "", cells[2])
            table[cells[0]] = {w for w in re.findall(r"[a-z]+", named) if w in STATES}
    return table


def test_the_documented_deployment_table_is_the_enforced_one() -> None:
    enforced = {source: set(targets) for source, targets in DEPLOYMENT_LIFECYCLE.moves.items()}
    assert documented_deployment_table() == enforced
    assert set(enforced) == set(STATES)  # every state has a row


@pytest.mark.parametrize("current", STATES)
@pytest.mark.parametrize("to", STATES)
def test_a_deployment_moves_only_as_the_table_allows(make_deployment, current, to) -> None:
    deployment = make_deployment(state=current)
    if to in DEPLOYMENT_LIFECYCLE.moves[current]:
        deployment.transition(to, "why")
        assert (deployment.state, deployment.state_reason) == (to, "why")
        assert deployment.state_changed_at is not None
    else:
        with pytest.raises(TransitionError) as refused:
            deployment.transition(to, "why")
        assert refused.value.field == "state"
        assert f"cannot go from {current} to {to}" in str(refused.value)
        assert deployment.state == current  # nothing was set


def _section(title: str) -> str:
    return DOC.read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _cells(line: str) -> list[str]:
    return [re.sub(r"\([^)]*\)", "", c).strip() for c in line.strip().strip("|").split("|")]


def test_the_documented_node_table_is_the_enforced_one() -> None:
    states = [s.value for s in NodeStatus]
    documented: set[tuple[str, str]] = set()
    for line in _section("Node").splitlines():
        cells = _cells(line)
        if len(cells) == 4 and cells[2] in states:
            sources = states if cells[0] == "any" else [cells[0]]
            documented |= {(s, cells[2]) for s in sources if s != cells[2]}
    enforced = {(s, t) for s, targets in NODE_LIFECYCLE.moves.items() for t in targets}
    assert documented == enforced


def _status_table(title: str, states: list[str]) -> dict[str, set[str]]:
    """A "status | meaning | next" table: each status and the ones it may move to."""
    documented: dict[str, set[str]] = {}
    for line in _section(title).splitlines():
        cells = _cells(line)
        if len(cells) == 3 and cells[0] in states:
            documented[cells[0]] = {t.strip() for t in cells[2].split(";") if t.strip() in states}
    return documented


@pytest.mark.parametrize(
    ("title", "states", "lifecycle"),
    [
        ("Benchmark run", [s.value for s in RunStatus], RUN_LIFECYCLE),
        ("Agent command", [s.value for s in CommandStatus], COMMAND_LIFECYCLE),
    ],
)
def test_the_documented_status_tables_are_the_enforced_ones(title, states, lifecycle) -> None:
    enforced = {s: set(t) for s, t in lifecycle.moves.items()}
    assert _status_table(title, states) == enforced
    assert set(enforced) == set(states)  # every status has a row


def test_a_command_takes_one_result_and_leaves_one_audit_row(node) -> None:
    command = AgentCommand.objects.create(node=node, action="stop", role="gpu", spec={})
    command = AgentCommand.objects.select_related("node").get(pk=command.pk)
    assert workflow.record_command_result(command, status="succeeded", detail="", output={})
    late = AgentCommand.objects.select_related("node").get(pk=command.pk)
    assert not workflow.record_command_result(late, status="expired", detail="late", output={})
    late.refresh_from_db()
    assert (late.status, late.detail) == ("succeeded", "")
    rows = AuditEntry.objects.filter(
        object_type="deployments.agentcommand", object_id=str(command.pk)
    )
    assert [(r.action, r.actor_label) for r in rows] == [
        ("command.succeeded", f"agent:{node.name}")
    ]
    with pytest.raises(TransitionError, match="cannot go from queued to queued"):
        workflow.record_command_result(late, status="queued", detail="", output={})


@pytest.mark.parametrize(
    ("current", "to", "allowed"),
    [
        ("online", "draining", True),
        ("offline", "draining", True),
        ("draining", "online", True),
        ("offline", "online", False),  # only a heartbeat brings a lost node back
        ("pending", "online", False),
        ("online", "offline", False),
        ("draining", "pending", False),
    ],
)
def test_a_person_drains_and_undrains_and_nothing_else(admin_client, node, current, to, allowed):
    node.status = current
    node.save()
    answer = admin_client.patch(f"/api/v1/nodes/{node.pk}/", {"status": to}, format="json")
    assert answer.status_code == (200 if allowed else 400), answer.content
    node.refresh_from_db()
    assert node.status == (to if allowed else current)


def test_a_finished_run_stays_finished(db) -> None:
    scenario = Scenario.objects.create(name="finish-once", input_tokens=8, output_tokens=4)
    run = BenchmarkRun.objects.create(
        scenario=scenario, status="running", target_url="http://127.0.0.1:7010"
    )
    _finish(run.pk, RunStatus.CANCELLED, error="")
    _finish(run.pk, RunStatus.FAILED, error="a late failure of the cancelled run")
    run.refresh_from_db()
    assert (run.status, run.error) == ("cancelled", "")


def test_a_table_names_every_target_as_a_state_of_its_own() -> None:
    with pytest.raises(ValueError, match="targets without a row"):
        Lifecycle("status", {"a": {"b"}})


def test_machine_credentials_issued_and_revoked_leave_audit_rows(admin_client, node) -> None:
    answer = admin_client.post(
        "/api/v1/credentials/", {"kind": "router", "name": "r-audit"}, format="json"
    )
    assert answer.status_code == 201, answer.content
    pk = answer.json()["id"]
    issued = AuditEntry.objects.get(action="credential.issued", object_id=str(pk))
    assert issued.actor is not None and issued.detail["name"] == "r-audit"
    for _ in range(2):  # a second revoke changes nothing and records nothing
        assert admin_client.post(f"/api/v1/credentials/{pk}/revoke/").status_code == 200
    assert AuditEntry.objects.filter(action="credential.revoked", object_id=str(pk)).count() == 1
    MachineCredential.issue("agent", "a-audit", node=node, created_by="syshax up")
    assert AuditEntry.objects.filter(
        action="credential.issued", actor_label="syshax up", detail__node=node.name
    ).exists()


def test_a_lost_node_marks_its_deployments_unknown_with_an_audit_row(make_deployment, node):
    running = make_deployment(node=node, name="was-running", state="running")
    stopped = make_deployment(node=node, name="was-stopped", state="stopped")
    assert services.mark_node_deployments_unknown(node) == 1
    running.refresh_from_db()
    stopped.refresh_from_db()
    assert (running.state, stopped.state) == ("unknown", "stopped")
    entry = AuditEntry.objects.get(action="deployment.unknown")
    assert (entry.object_id, entry.actor_label) == (str(running.pk), "reaper")


def test_a_container_status_change_is_audited_once_not_every_report(make_deployment, node):
    deployment = make_deployment(node=node, name="synced", state="running", generation=1)
    report = [{"deployment_id": deployment.pk, "role": "gpu", "generation": 1, "status": "running"}]

    def audited() -> list[tuple[str | None, str]]:
        return [
            (e.detail["from"], e.detail["to"])
            for e in AuditEntry.objects.filter(action="container.status").order_by("pk")
        ]

    services.sync_containers(node, report)
    services.sync_containers(node, report)  # nothing changed: nothing recorded
    assert audited() == [(None, "running")]
    services.sync_containers(node, [{**report[0], "status": "exited", "exit_code": 1}])
    services.sync_containers(node, [])  # no longer reported: missing
    assert audited() == [(None, "running"), ("running", "exited"), ("exited", "missing")]
    assert ContainerInstance.objects.get(deployment=deployment).status == "missing"
    assert {e.actor_label for e in AuditEntry.objects.filter(action="container.status")} == {
        f"agent:{node.name}"
    }
