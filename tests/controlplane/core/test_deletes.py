"""Deletes go through one service per model (controlplane/core/services.py): the API, the
admin's object page and its bulk action keep the same rules and write an audit row, and a
deployment whose engines may still run never loses its claimed cards (docs/lifecycles.md,
"Deleting")."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.test import Client
from django.urls import reverse

from controlplane.access.models import MachineCredential, PersonalToken
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample, Scenario
from controlplane.core.models import AuditEntry
from controlplane.deployments import services
from controlplane.deployments.models import (
    AcceleratorClaim,
    AgentCommand,
    ContainerInstance,
    Deployment,
    DeploymentEvent,
    DeploymentProfile,
)
from controlplane.inventory.models import Accelerator, Heartbeat, Node
from controlplane.policy.models import SchedulingPolicy
from controlplane.policy.services import create_policy
from testbed.factories import build_deployment, build_node, build_profile

# Every state in which a deployment's engines may still run on its node.
ENGINES_MAY_RUN = ["deploying", "running", "stopping", "unknown"]


@pytest.fixture
def browser(admin_user) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


def deployed(state: str = "running", *, name: str = "live", **fields: Any) -> Deployment:
    """A deployment that claimed its node's cards by deploying, then moved to ``state``."""
    node = build_node(fields.pop("node_name", None), accelerators=2, status="online")
    profile = build_profile(tensor_parallel_size=2, enable_cpu_engine=False)
    deployment = build_deployment(node, profile, name=name, **fields)
    services.request_deploy(deployment, acting_user="test")
    Deployment.objects.filter(pk=deployment.pk).update(state=state)
    deployment.refresh_from_db()
    assert deployment.accelerator_claims.count() == 2
    return deployment


def stopped(name: str = "idle") -> Deployment:
    return build_deployment(build_node(), build_profile(), name=name, state="stopped")


def claimed_cards() -> set[str]:
    return set(AcceleratorClaim.objects.values_list("accelerator__uuid", flat=True))


def message(response) -> str:
    return response.json()["error"]["message"]


def deleted_rows(action: str, obj: Any) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action=action, object_id=str(obj.pk)))


def admin_url(obj: Any, view: str) -> str:
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=[obj.pk])


def admin_bulk_delete(browser: Client, model: type, objects: list[Any]):
    opts = model._meta
    return browser.post(
        reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"),
        {"action": "delete_selected", "_selected_action": [o.pk for o in objects], "post": "yes"},
    )


# --- a deployment whose engines may run -------------------------------------------------


@pytest.fixture(params=ENGINES_MAY_RUN)
def live(request, db) -> Deployment:
    """A deployment in each state in which its engines may still run, holding its cards."""
    return deployed(request.param)


def test_the_admin_refuses_to_delete_a_deployment_whose_engines_may_run(browser, live) -> None:
    deployment, state, cards = live, live.state, claimed_cards()
    page = browser.get(admin_url(deployment, "delete"))
    assert page.status_code == 200
    assert "Cannot delete deployment" in page.content.decode()
    assert f"it is {state}; stop it first" in page.content.decode()

    confirmed = browser.post(admin_url(deployment, "delete"), {"post": "yes"})
    assert confirmed.status_code == 200  # the refusal page again, nothing deleted
    assert Deployment.objects.filter(pk=deployment.pk).exists()
    assert claimed_cards() == cards
    assert not deleted_rows("deployment.deleted", deployment)


def test_the_admins_bulk_delete_keeps_the_same_rules(browser, admin_user) -> None:
    live = deployed("running")
    idle = stopped()
    cards = claimed_cards()
    refused = admin_bulk_delete(browser, Deployment, [live, idle])
    assert refused.status_code == 200
    assert "Cannot delete deployments" in refused.content.decode()
    assert set(Deployment.objects.values_list("name", flat=True)) == {"live", "idle"}
    assert claimed_cards() == cards

    other = stopped("idle-2")
    done = admin_bulk_delete(browser, Deployment, [idle, other])
    assert done.status_code == 302
    assert set(Deployment.objects.values_list("name", flat=True)) == {"live"}
    for gone in (idle, other):
        (row,) = deleted_rows("deployment.deleted", gone)
        assert row.actor == admin_user and row.detail["name"] == gone.name
    assert claimed_cards() == cards


def test_the_api_refuses_to_delete_a_deployment_whose_engines_may_run(admin_client, live) -> None:
    cards = claimed_cards()
    response = admin_client.delete(f"/api/v1/deployments/{live.pk}/")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "conflict"
    assert message(response) == (
        f"cannot delete deployment 'live' while its engines may run: it is {live.state}; "
        "stop it first"
    )
    assert Deployment.objects.filter(pk=live.pk).exists()
    assert claimed_cards() == cards


def test_a_deployment_whose_replica_still_runs_is_kept_with_the_replicas_cards(
    admin_client, browser
) -> None:
    replica = deployed("running", name="wide-r2")
    first = build_deployment(replica.node, replica.profile, name="wide", state="stopped")
    Deployment.objects.filter(pk=replica.pk).update(replica_of=first, replica_index=2)
    cards = claimed_cards()
    response = admin_client.delete(f"/api/v1/deployments/{first.pk}/")
    assert response.status_code == 409
    assert "its replica 'wide-r2' is running; stop it first" in message(response)
    browser.post(admin_url(first, "delete"), {"post": "yes"})
    assert Deployment.objects.count() == 2
    assert claimed_cards() == cards


def test_a_failed_deployment_is_kept_until_its_cleanup_is_done(admin_client) -> None:
    deployment = stopped()
    Deployment.objects.filter(pk=deployment.pk).update(state="failed", step="cleanup-gpu")
    response = admin_client.delete(f"/api/v1/deployments/{deployment.pk}/")
    assert response.status_code == 409
    assert "is failed and still removing its engines (step cleanup-gpu)" in message(response)
    Deployment.objects.filter(pk=deployment.pk).update(step="")
    assert admin_client.delete(f"/api/v1/deployments/{deployment.pk}/").status_code == 204


@pytest.mark.parametrize("state", ["stopped", "pending", "failed"])
def test_a_deployment_without_engines_is_deleted_through_the_api_with_an_audit_row(
    admin_client, admin_user, state: str
) -> None:
    deployment = stopped()
    Deployment.objects.filter(pk=deployment.pk).update(state=state)
    response = admin_client.delete(f"/api/v1/deployments/{deployment.pk}/")
    assert response.status_code == 204
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    (row,) = deleted_rows("deployment.deleted", deployment)
    assert row.actor == admin_user
    assert row.detail["state"] == state and row.detail["node"] == deployment.node.name


def test_the_admin_deletes_a_stopped_deployment_with_an_audit_row(browser, admin_user) -> None:
    deployment = stopped()
    response = browser.post(admin_url(deployment, "delete"), {"post": "yes"})
    assert response.status_code == 302
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    (row,) = deleted_rows("deployment.deleted", deployment)
    assert row.actor == admin_user
    assert LogEntry.objects.filter(action_flag=DELETION, object_id=str(deployment.pk)).exists()


def test_a_retired_replica_is_deleted_through_the_service(db) -> None:
    for name in ("pair-a", "pair-b"):
        build_node(name, status="online")
    first = services.create_deployment(
        name="pair",
        profile=build_profile(enable_cpu_engine=False),
        node=None,
        acting_user="test",
        replicas=2,
    )
    replica = first.replica_set.get()
    services.set_replicas(first, 1, acting_user="test")
    assert not Deployment.objects.filter(pk=replica.pk).exists()
    (row,) = deleted_rows("deployment.deleted", replica)
    assert row.actor_label == "test" and row.detail["state"] == "pending"


def test_the_benchmark_run_rule_answers_the_same_in_the_admin(browser) -> None:
    deployment = stopped()
    BenchmarkRun.objects.create(scenario=Scenario.objects.get(name="short"), deployment=deployment)
    page = browser.post(admin_url(deployment, "delete"), {"post": "yes"})
    assert "is the only target of 1 benchmark run" in page.content.decode()
    assert Deployment.objects.filter(pk=deployment.pk).exists()


# --- what a running deployment uses -----------------------------------------------------


def test_the_node_and_profile_of_a_running_deployment_are_kept_with_its_cards(
    admin_client, browser
) -> None:
    deployment = deployed("running")
    cards = claimed_cards()
    node, profile = deployment.node, deployment.profile
    for url in (f"/api/v1/nodes/{node.pk}/", f"/api/v1/profiles/{profile.pk}/"):
        assert admin_client.delete(url).status_code == 409
    for obj in (node, profile):
        page = browser.post(admin_url(obj, "delete"), {"post": "yes"})
        assert page.status_code == 200 and "Cannot delete" in page.content.decode()
    for model in (Node, DeploymentProfile):
        admin_bulk_delete(browser, model, list(model.objects.all()))
    assert Node.objects.filter(pk=node.pk).exists()
    assert DeploymentProfile.objects.filter(pk=profile.pk).exists()
    assert claimed_cards() == cards


def test_a_node_whose_cards_are_claimed_from_elsewhere_is_kept(admin_client, browser) -> None:
    deployment = deployed("running", node_name="first-home")
    old_home = deployment.node
    # Its operator named another node in the admin while it ran; its cards stay claimed.
    Deployment.objects.filter(pk=deployment.pk).update(node=build_node("second-home"))
    cards = claimed_cards()
    response = admin_client.delete(f"/api/v1/nodes/{old_home.pk}/")
    assert response.status_code == 409
    assert message(response) == (
        "cannot delete node 'first-home' while deployments hold its cards: live (stop them first)"
    )
    page = browser.post(admin_url(old_home, "delete"), {"post": "yes"})
    assert "while deployments hold its cards" in page.content.decode()
    assert Node.objects.filter(pk=old_home.pk).exists()
    assert claimed_cards() == cards


def test_a_claimed_card_is_kept_and_a_free_one_deleted_in_the_admin(browser, admin_user) -> None:
    deployment = deployed("running")
    claimed = Accelerator.objects.get(claim__deployment=deployment, index=0)
    free = Accelerator.objects.create(
        node=deployment.node, kind="gpu", index=7, uuid="GPU-spare", memory_total_bytes=1
    )
    page = browser.post(admin_url(claimed, "delete"), {"post": "yes"})
    assert "while deployment &#x27;live&#x27; holds it" in page.content.decode()
    refused = admin_bulk_delete(browser, Accelerator, [claimed, free])
    assert "Cannot delete" in refused.content.decode()
    assert Accelerator.objects.filter(pk__in=[claimed.pk, free.pk]).count() == 2
    assert browser.post(admin_url(free, "delete"), {"post": "yes"}).status_code == 302
    (row,) = deleted_rows("accelerator.deleted", free)
    assert row.actor == admin_user and row.detail["uuid"] == "GPU-spare"
    assert deployment.accelerator_claims.count() == 2


# --- the other delete services ----------------------------------------------------------


def test_unused_objects_are_deleted_with_an_audit_row_through_the_api(
    admin_client, admin_user
) -> None:
    node = build_node()
    profile = build_profile()
    policy = create_policy(name="spare", acting_user="test", reason="test")
    scenario = Scenario.objects.create(name="mine", input_tokens=8, output_tokens=8)
    for url, action, obj in (
        (f"/api/v1/nodes/{node.pk}/", "node.deleted", node),
        (f"/api/v1/profiles/{profile.pk}/", "profile.deleted", profile),
        ("/api/v1/policies/spare/", "policy.deleted", policy),
        ("/api/v1/scenarios/mine/", "scenario.deleted", scenario),
    ):
        response = admin_client.delete(url)
        assert response.status_code == 204, (url, response.content)
        assert not type(obj).objects.filter(pk=obj.pk).exists()
        (row,) = deleted_rows(action, obj)
        assert row.actor == admin_user and row.detail["name"] == str(obj)


def test_unused_objects_are_deleted_with_an_audit_row_in_the_admin(browser, admin_user) -> None:
    objects = [
        build_node(),
        build_profile(),
        create_policy(name="spare", acting_user="test", reason="test"),
        Scenario.objects.create(name="mine", input_tokens=8, output_tokens=8),
    ]
    for obj in objects:
        assert browser.post(admin_url(obj, "delete"), {"post": "yes"}).status_code == 302
    bulk = [build_node(), build_node()]
    assert admin_bulk_delete(browser, Node, bulk).status_code == 302
    for obj, action in zip(
        [*objects, *bulk],
        ["node", "profile", "policy", "scenario", "node", "node"],
        strict=True,
    ):
        assert not type(obj).objects.filter(pk=obj.pk).exists()
        (row,) = deleted_rows(f"{action}.deleted", obj)
        assert row.actor == admin_user


def test_the_default_policy_and_built_in_scenarios_are_kept(admin_client, browser) -> None:
    default = SchedulingPolicy.objects.get(name="default")
    short = Scenario.objects.get(name="short")
    answers = {
        "/api/v1/policies/default/": "the default policy cannot be deleted",
        "/api/v1/scenarios/short/": "'short' is built in and cannot be deleted",
    }
    for url, why in answers.items():
        response = admin_client.delete(url)
        assert response.status_code == 409
        assert message(response) == why
    for obj in (default, short):
        page = browser.post(admin_url(obj, "delete"), {"post": "yes"})
        assert "cannot be deleted" in page.content.decode()
        assert type(obj).objects.filter(pk=obj.pk).exists()


def test_a_policy_or_scenario_in_use_is_a_409_naming_its_users(admin_client) -> None:
    policy = create_policy(name="used", acting_user="test", reason="test")
    deployment = stopped("uses-it")
    Deployment.objects.filter(pk=deployment.pk).update(policy=policy)
    scenario = Scenario.objects.create(name="measured", input_tokens=8, output_tokens=8)
    BenchmarkRun.objects.create(scenario=scenario, name="run-1", target_url="http://127.0.0.1:1")
    response = admin_client.delete("/api/v1/policies/used/")
    assert response.status_code == 409
    assert message(response) == "cannot delete it while it is still used by deployments: uses-it"
    response = admin_client.delete("/api/v1/scenarios/measured/")
    assert response.status_code == 409
    assert message(response).startswith("cannot delete it while it is still used by benchmark")
    assert not AuditEntry.objects.filter(action__endswith=".deleted").exists()


# --- benchmark runs ----------------------------------------------------------------------


def a_run(status: str) -> BenchmarkRun:
    return BenchmarkRun.objects.create(
        scenario=Scenario.objects.get(name="short"),
        deployment=stopped(f"bench-{status}"),
        status=status,
    )


@pytest.mark.parametrize("status", ["queued", "running"])
def test_a_run_a_worker_may_be_measuring_is_kept_until_cancelled(
    admin_client, browser, status
) -> None:
    run = a_run(status)
    refused = admin_client.delete(f"/api/v1/benchmark-runs/{run.pk}/")
    assert refused.status_code == 409
    assert message(refused) == (
        f"cannot delete benchmark run {run.pk} while it is {status}; cancel it first"
    )
    page = browser.post(admin_url(run, "delete"), {"post": "yes"})
    assert "cancel it first" in page.content.decode()
    assert BenchmarkRun.objects.filter(pk=run.pk).exists()
    assert not deleted_rows("benchmark.deleted", run)


def test_a_finished_run_is_deleted_with_its_samples_and_an_audit_row(
    admin_client, admin_user
) -> None:
    run = a_run("succeeded")
    BenchmarkSample.objects.create(run=run, mode="gpu", concurrency=1, index=0)
    response = admin_client.delete(f"/api/v1/benchmark-runs/{run.pk}/")
    assert response.status_code == 204
    assert not BenchmarkRun.objects.filter(pk=run.pk).exists()
    assert not BenchmarkSample.objects.filter(run_id=run.pk).exists()
    (row,) = deleted_rows("benchmark.deleted", run)
    assert row.actor == admin_user and row.detail["status"] == "succeeded"


# --- the system's own records --------------------------------------------------------------


def with_history(deployment: Deployment) -> AgentCommand:
    """A command to the deployment's node and an event on its timeline, as a deploy leaves."""
    DeploymentEvent.objects.create(deployment=deployment, step="deploy", message="deploying")
    return AgentCommand.objects.create(
        node=deployment.node, deployment=deployment, action="start", role="gpu", step=""
    )


def records(admin_user) -> list[Any]:
    """One row of each model the system writes as its record, or that is revoked rather than
    deleted."""
    deployment = deployed("running", name="recorded")
    command = with_history(deployment)
    event = DeploymentEvent.objects.filter(deployment=deployment).first()
    container = ContainerInstance.objects.create(
        deployment=deployment, role="gpu", generation=1, name="recorded-gpu"
    )
    heartbeat = Heartbeat.objects.create(node=deployment.node)
    run = a_run("succeeded")
    sample = BenchmarkSample.objects.create(run=run, mode="gpu", concurrency=1, index=0)
    credential, _ = MachineCredential.issue("agent", "agent-a", node=deployment.node)
    token, _ = PersonalToken.issue(admin_user, "laptop", acting_user=admin_user)
    audit_row = AuditEntry.objects.order_by("-pk").first()
    return [command, event, container, heartbeat, sample, credential, token, audit_row]


def test_the_systems_records_are_not_deleted_by_hand_in_the_admin(browser, admin_user) -> None:
    for record in records(admin_user):
        model = type(record)
        opts = model._meta
        changelist = browser.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
        assert changelist.status_code == 200, model
        assert 'value="delete_selected"' not in changelist.content.decode(), model
        change = browser.get(admin_url(record, "change"))
        assert change.status_code == 200, model
        assert admin_url(record, "delete") not in change.content.decode(), model
        assert browser.get(admin_url(record, "delete")).status_code == 403, model
        assert browser.post(admin_url(record, "delete"), {"post": "yes"}).status_code == 403
        bulk = admin_bulk_delete(browser, model, [record])
        assert model._default_manager.filter(pk=record.pk).exists(), (model, bulk.status_code)


def test_a_stopped_deployment_takes_its_records_along(browser, admin_user) -> None:
    deployment = deployed("running", name="done")
    with_history(deployment)
    AcceleratorClaim.objects.filter(deployment=deployment).delete()  # as a stop releases them
    Deployment.objects.filter(pk=deployment.pk).update(state="stopped")
    assert AgentCommand.objects.filter(deployment=deployment).exists()
    assert DeploymentEvent.objects.filter(deployment=deployment).exists()
    response = browser.post(admin_url(deployment, "delete"), {"post": "yes"})
    assert response.status_code == 302
    assert not AgentCommand.objects.filter(deployment_id=deployment.pk).exists()
    assert not DeploymentEvent.objects.filter(deployment_id=deployment.pk).exists()
    assert deleted_rows("deployment.deleted", deployment)
