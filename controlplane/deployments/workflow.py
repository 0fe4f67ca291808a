"""The deploy/stop workflow. The Deployment row holds its state; ``advance`` moves it one step.

Every step issues one command to the node's agent (an :class:`AgentCommand` row the agent
fetches, see :mod:`controlplane.deployments.delivery`) and waits for the agent's result (see
docs/lifecycles.md). ``advance`` is idempotent: it re-reads the row under a lock and
finds each step's command by (deployment, generation, step), so running it twice — or after a
redelivery — never sends a command twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from common.hosts import http_url
from controlplane.core import audit, dispatch, tracing
from controlplane.deployments import delivery
from controlplane.deployments.choices import (
    ADVANCE_TASK,
    COMMAND_LIFECYCLE,
    CommandAction,
    CommandStatus,
    DeploymentAuditAction,
    DeploymentState,
    DesiredState,
    EventLevel,
    StepName,
)
from controlplane.deployments.models import AgentCommand, Deployment
from controlplane.deployments.services import add_event, retire_replica, set_state
from controlplane.deployments.specs import engine_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    name: str
    action: str
    role: str
    # For stops: keep the current generation's engines (a redeploy removes only older ones).
    keep_current: bool = False

    @property
    def describes(self) -> str:
        verb = "stop" if self.action == CommandAction.STOP else "start"
        scope = "previous " if self.keep_current else ""
        return f"{verb} {scope}{self.role.upper()} engine"


DEPLOY_STEPS = (
    Step(StepName.STOP_OLD_CPU, CommandAction.STOP, "cpu", keep_current=True),
    Step(StepName.STOP_OLD_GPU, CommandAction.STOP, "gpu", keep_current=True),
    Step(StepName.START_GPU, CommandAction.START, "gpu"),
    Step(StepName.START_CPU, CommandAction.START, "cpu"),
)
STOP_STEPS = (
    Step(StepName.STOP_CPU, CommandAction.STOP, "cpu"),
    Step(StepName.STOP_GPU, CommandAction.STOP, "gpu"),
)
CLEANUP_STEPS = (
    Step(StepName.CLEANUP_CPU, CommandAction.STOP, "cpu"),
    Step(StepName.CLEANUP_GPU, CommandAction.STOP, "gpu"),
)


def plan_for(deployment: Deployment) -> tuple[Step, ...]:
    if deployment.state == DeploymentState.FAILED:
        return CLEANUP_STEPS
    if deployment.desired_state == DesiredState.RUNNING:
        steps: tuple[Step, ...] = DEPLOY_STEPS
        if not deployment.profile.enable_cpu_engine:
            steps = tuple(s for s in steps if s.name != StepName.START_CPU)
        return steps
    return STOP_STEPS


def command_spec(deployment: Deployment, step: Step) -> dict[str, Any]:
    if step.action == CommandAction.START:
        return engine_spec(deployment, step.role)
    return {
        "deployment": deployment.name,
        "deployment_id": deployment.pk,
        "role": step.role,
        "keep_generation": deployment.generation if step.keep_current else None,
    }


def send_command(command: AgentCommand) -> None:
    """The row is the command: wake the node's agent if it is waiting for one."""
    delivery.wake(command.node_id)


def advance(deployment_id: int) -> str:
    """Move the deployment one step forward. Returns the step it now waits on, or its state."""
    with transaction.atomic():
        deployment = (
            Deployment.objects.select_for_update()
            .select_related("profile", "node")
            .get(pk=deployment_id)
        )
        tracing.annotate(deployment=deployment.name, generation=deployment.generation)
        if deployment.state not in (
            DeploymentState.DEPLOYING,
            DeploymentState.STOPPING,
            DeploymentState.FAILED,
        ):
            return deployment.state
        steps = plan_for(deployment)
        commands = {
            c.step: c
            for c in AgentCommand.objects.filter(
                deployment=deployment,
                generation=deployment.generation,
                step__in=[s.name for s in steps],
            )
        }
        for step in steps:
            command = commands.get(step.name)
            if command is None:
                _dispatch(deployment, step)
                return step.name
            if command.status == CommandStatus.QUEUED:
                return step.name
            if command.status != CommandStatus.SUCCEEDED:
                if deployment.state == DeploymentState.FAILED:
                    # A cleanup step failed: record it and keep going so nothing is skipped.
                    continue
                _fail(deployment, step, command)
                return DeploymentState.FAILED
        _finish(deployment, steps)
        return deployment.state


def _dispatch(deployment: Deployment, step: Step) -> None:
    command = AgentCommand.objects.create(
        node=deployment.node,
        deployment=deployment,
        action=step.action,
        role=step.role,
        generation=deployment.generation,
        step=step.name,
        spec=command_spec(deployment, step),
        traceparent=tracing.current_traceparent(),
    )
    deployment.step = step.name
    deployment.save(update_fields=["step", "updated_at"])
    add_event(
        deployment,
        step.name,
        f"{step.describes}: sent to agent of node {deployment.node.name}",
        detail={"dispatch_id": str(command.dispatch_id)},
    )
    transaction.on_commit(lambda: send_command(command))


def _fail(deployment: Deployment, step: Step, command: AgentCommand) -> None:
    role = step.role.upper()
    reason = command.detail or f"{role} engine command {command.status}"
    if not reason.startswith(role):
        reason = f"{step.describes} failed: {reason}"
    set_state(deployment, DeploymentState.FAILED, reason)
    deployment.step = ""
    deployment.save()
    add_event(deployment, step.name, reason, level=EventLevel.ERROR)
    # Clean up whatever part of this generation started, CPU first, so nothing is orphaned.
    for cleanup in CLEANUP_STEPS:
        _dispatch(deployment, cleanup)


def _finish(deployment: Deployment, steps: tuple[Step, ...]) -> None:
    if deployment.state == DeploymentState.FAILED:
        add_event(deployment, "cleanup", "partial engines removed", level=EventLevel.WARNING)
        deployment.step = ""
        deployment.save(update_fields=["step", "updated_at"])
        return
    profile = deployment.profile
    host = deployment.node.engine_host
    if deployment.desired_state == DesiredState.RUNNING:
        deployment.gpu_endpoint = http_url(host, profile.gpu_port)
        deployment.cpu_endpoint = (
            http_url(host, profile.cpu_port) if profile.enable_cpu_engine else ""
        )
        set_state(deployment, DeploymentState.RUNNING, "")
        message = "running; endpoints published to routers"
    else:
        deployment.gpu_endpoint = ""
        deployment.cpu_endpoint = ""
        set_state(deployment, DeploymentState.STOPPED, "")
        message = "stopped"
    deployment.step = ""
    deployment.save()
    add_event(deployment, deployment.state, message)
    if deployment.retiring and deployment.state == DeploymentState.STOPPED:
        # A replica beyond its deployment's count: gone once its engines are.
        log.info("replica %s retired", deployment.name)
        retire_replica(deployment, acting_user="control plane")


def record_command_result(
    command: AgentCommand, *, status: str, detail: str, output: dict[str, Any]
) -> bool:
    """Store an agent's result (or the expiry) once. Returns False for a repeat (already
    completed). A status the command's table does not lead to raises TransitionError."""
    sources = COMMAND_LIFECYCLE.sources(status)
    if not sources:
        COMMAND_LIFECYCLE.check(CommandStatus.QUEUED, status)
    # The callers loaded the node with the command; the refresh below drops it.
    actor = "control plane" if status == CommandStatus.EXPIRED else f"agent:{command.node.name}"
    with transaction.atomic():
        updated = AgentCommand.objects.filter(pk=command.pk, status__in=sources).update(
            status=status, detail=detail[:10000], output=output, completed_at=timezone.now()
        )
        if not updated:
            # A repeat: the agent sends a result again when its first answer was an error,
            # which may mean the advance queued with it never reached the broker (Redis
            # down). advance is idempotent, so queue it again rather than wait for beat.
            if command.deployment_id is not None:
                dispatch.enqueue(ADVANCE_TASK, command.deployment_id)
            return False
        command.refresh_from_db()
        audit.record(
            DeploymentAuditAction(f"command.{status}"),
            command,
            acting_user=actor,
            detail={
                "deployment": command.deployment_id,
                "action": command.action,
                "role": command.role,
                "step": command.step,
                "dispatch_id": str(command.dispatch_id),
            },
        )
        if command.deployment_id is not None:
            deployment = command.deployment
            assert deployment is not None
            level = EventLevel.INFO if status == CommandStatus.SUCCEEDED else EventLevel.ERROR
            text = detail or f"{command.role.upper()} engine {command.action} {status}"
            add_event(deployment, command.step or command.action, text, level=level)
            dispatch.enqueue(ADVANCE_TASK, command.deployment_id)
    return True


def expire_stale_commands(older_than_seconds: float, max_attempts: int = 3) -> int:
    """Commands without a result. One handed out ``older_than_seconds`` (plus its engine's
    health timeout) ago is offered again; after ``max_attempts`` hand-outs, or when no agent
    fetched it for ``max_attempts * older_than_seconds``, it expires and its deployment's
    workflow moves on (to failed). Returns how many commands it touched."""
    now = timezone.now()
    count = 0
    stale = AgentCommand.objects.filter(status=CommandStatus.QUEUED).filter(
        Q(delivered_at__isnull=True, created_at__lt=now - timedelta(seconds=older_than_seconds))
        | Q(delivered_at__lt=now - timedelta(seconds=older_than_seconds))
    )
    for command in stale.select_related("node"):
        timeout = float(command.spec.get("health_timeout_seconds", 0) or 0)
        if command.delivered_at is None:
            if now - command.created_at < timedelta(seconds=older_than_seconds * max_attempts):
                continue
            detail = (
                f"the agent of node {command.node.name} did not fetch the command within "
                f"{older_than_seconds * max_attempts:g} s"
            )
        else:
            if now - command.delivered_at < timedelta(seconds=older_than_seconds + timeout):
                continue
            if command.attempts < max_attempts:
                # Offered again, even to the same agent session: its result may have been lost.
                AgentCommand.objects.filter(pk=command.pk, status=CommandStatus.QUEUED).update(
                    delivered_to=""
                )
                delivery.wake(command.node_id)
                count += 1
                continue
            detail = (
                f"no result from the agent of node {command.node.name} after "
                f"{command.attempts} deliveries"
            )
        record_command_result(command, status=CommandStatus.EXPIRED, detail=detail, output={})
        count += 1
    return count
