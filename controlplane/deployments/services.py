"""Deployment operations. Each runs in one transaction, writes a timeline event and an audit
row, and queues the workflow task only after the transaction commits."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.core import audit
from controlplane.deployments.choices import DeploymentState, DesiredState, EventLevel
from controlplane.deployments.models import Deployment, DeploymentEvent, DeploymentProfile
from controlplane.deployments.placement import PlacementError, check_placement
from controlplane.inventory.models import Node
from controlplane.policy.models import SchedulingPolicy
from controlplane.policy.services import ensure_default_policy


def add_event(
    deployment: Deployment,
    step: str,
    message: str,
    *,
    level: str = EventLevel.INFO,
    detail: dict[str, Any] | None = None,
) -> DeploymentEvent:
    return DeploymentEvent.objects.create(
        deployment=deployment,
        generation=deployment.generation,
        step=step,
        level=level,
        message=message,
        detail=detail or {},
    )


def set_state(deployment: Deployment, state: str, reason: str = "") -> None:
    deployment.state = state
    deployment.state_reason = reason
    deployment.state_changed_at = timezone.now()


def _queue_advance(deployment_id: int) -> None:
    from controlplane.deployments import tasks

    transaction.on_commit(lambda: tasks.advance_deployment.delay(deployment_id))


def placement_plan(
    profile: DeploymentProfile, node: Node, deployment: Deployment | None = None
) -> dict[str, Any]:
    """Check the profile fits the node and plan the CPU engine's cores; raise the first
    PlacementError (it names the field and the limit), carrying all of them in ``problems``."""
    problems = check_placement(profile, node)
    if problems:
        first = problems[0]
        first.problems = problems
        raise first
    if not profile.enable_cpu_engine:
        return {}
    from controlplane.deployments.affinity import plan_for

    return plan_for(profile, node, deployment=deployment)


def create_deployment(
    *,
    name: str,
    profile: DeploymentProfile,
    node: Node,
    policy: SchedulingPolicy | None = None,
    acting_user: Any,
    start: bool = False,
) -> Deployment:
    plan = placement_plan(profile, node)
    user, _ = audit.split_actor(acting_user)
    with transaction.atomic():
        deployment = Deployment.objects.create(
            name=name,
            profile=profile,
            node=node,
            affinity_plan=plan,
            policy=policy or ensure_default_policy(),
            created_by=user,
        )
        add_event(deployment, "created", f"profile {profile.name} placed on node {node.name}")
        audit.record("deployment.created", deployment, acting_user=acting_user)
        if start:
            request_deploy(deployment, acting_user=acting_user)
    return deployment


def request_deploy(deployment: Deployment, *, acting_user: Any) -> Deployment:
    """Start (or redeploy after a profile change): a new generation, GPU first then CPU."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        locked.affinity_plan = placement_plan(locked.profile, locked.node, locked)
        locked.generation += 1
        locked.desired_state = DesiredState.RUNNING
        locked.step = ""
        set_state(locked, DeploymentState.DEPLOYING, "deploy requested")
        locked.save()
        add_event(locked, "deploy", f"deploy of generation {locked.generation} requested")
        audit.record(
            "deployment.deploy",
            locked,
            acting_user=acting_user,
            detail={"generation": locked.generation},
        )
        _queue_advance(locked.pk)
    deployment.refresh_from_db()
    return deployment


def request_stop(deployment: Deployment, *, acting_user: Any) -> Deployment:
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.desired_state == DesiredState.STOPPED and locked.state == DeploymentState.STOPPED:
            return locked
        locked.desired_state = DesiredState.STOPPED
        locked.step = ""
        set_state(locked, DeploymentState.STOPPING, "stop requested")
        locked.save()
        add_event(locked, "stop", "stop requested")
        audit.record("deployment.stop", locked, acting_user=acting_user)
        _queue_advance(locked.pk)
    deployment.refresh_from_db()
    return deployment


def request_restart(deployment: Deployment, *, acting_user: Any) -> Deployment:
    """A restart is a redeploy of the same profile: old engines stop, a new generation starts."""
    return request_deploy(deployment, acting_user=acting_user)


def mark_node_deployments_unknown(node: Node) -> int:
    changed = 0
    for deployment in Deployment.objects.filter(node=node).exclude(
        state__in=[DeploymentState.STOPPED, DeploymentState.PENDING, DeploymentState.UNKNOWN]
    ):
        set_state(deployment, DeploymentState.UNKNOWN, f"node {node.name} stopped heartbeating")
        deployment.save(update_fields=["state", "state_reason", "state_changed_at", "updated_at"])
        add_event(deployment, "node-lost", deployment.state_reason, level=EventLevel.WARNING)
        changed += 1
    return changed


def sync_containers(node: Node, reported: list[dict[str, Any]]) -> int:
    """Store the containers an agent sees, then settle deployments left unknown."""
    from controlplane.deployments.models import ContainerInstance

    updated = 0
    with transaction.atomic():
        own = {d.pk: d for d in Deployment.objects.filter(node=node)}
        for item in reported:
            deployment = own.get(item["deployment_id"])
            if deployment is None:
                continue
            ContainerInstance.objects.update_or_create(
                deployment=deployment,
                role=item["role"],
                generation=item["generation"],
                defaults={
                    "engine_id": item.get("engine_id", ""),
                    "name": item.get("name", ""),
                    "status": item.get("status", "running"),
                    "health": item.get("health", "unknown"),
                    "exit_code": item.get("exit_code"),
                    "endpoint": item.get("endpoint", ""),
                },
            )
            updated += 1
        seen = {(i["deployment_id"], i["role"], i["generation"]) for i in reported}
        for container in ContainerInstance.objects.filter(deployment__node=node).exclude(
            status="missing"
        ):
            if (container.deployment_id, container.role, container.generation) not in seen:
                container.status = "missing"
                container.save(update_fields=["status", "updated_at"])
    reconcile_returning_node(node.pk)
    return updated


def reconcile_returning_node(node_id: int) -> int:
    """Settle the node's unknown deployments from the containers its agent last reported."""
    from controlplane.deployments.models import ContainerInstance

    settled = 0
    for deployment in Deployment.objects.filter(node_id=node_id, state=DeploymentState.UNKNOWN):
        with transaction.atomic():
            locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
            if locked.state != DeploymentState.UNKNOWN:
                continue
            roles = ["gpu", "cpu"] if locked.profile.enable_cpu_engine else ["gpu"]
            running = set(
                ContainerInstance.objects.filter(
                    deployment=locked, generation=locked.generation, status="running"
                ).values_list("role", flat=True)
            )
            if locked.desired_state == DesiredState.RUNNING and running >= set(roles):
                set_state(locked, DeploymentState.RUNNING, "")
                locked.save()
                add_event(locked, "node-back", "node is back; its engines kept running")
            elif locked.desired_state == DesiredState.STOPPED and not running:
                set_state(locked, DeploymentState.STOPPED, "")
                locked.save()
                add_event(locked, "node-back", "node is back; engines are stopped")
            else:
                continue
            settled += 1
    return settled


__all__ = [
    "PlacementError",
    "add_event",
    "create_deployment",
    "mark_node_deployments_unknown",
    "request_deploy",
    "request_restart",
    "request_stop",
]
