from __future__ import annotations

from celery import shared_task

from controlplane.core import tracing
from controlplane.deployments import workflow
from controlplane.deployments.choices import (
    ADVANCE_TASK,
    RECONCILE_NODE_TASK,
    RESCHEDULE_TASK,
    DeploymentState,
)
from controlplane.deployments.models import Deployment
from controlplane.deployments.services import (
    reconcile_returning_node,
    reschedule,
    stranded_deployments,
)


@shared_task(name=ADVANCE_TASK, ignore_result=True)
def advance_deployment(deployment_id: int) -> str:
    tracing.annotate(deployment_id=deployment_id)  # the task's span (docs/tracing.md)
    return workflow.advance(deployment_id)


@shared_task(name="deployments.expire_stale_commands", ignore_result=True)
def expire_stale_commands() -> int:
    return workflow.expire_stale_commands(older_than_seconds=60.0)


@shared_task(name=RESCHEDULE_TASK, ignore_result=True)
def reschedule_deployment(deployment_id: int) -> str:
    """A placed deployment's node was lost: place it again elsewhere."""
    return reschedule(deployment_id)


@shared_task(name="deployments.reschedule_stranded", ignore_result=True)
def reschedule_stranded() -> int:
    """Beat: try again for placed deployments still stranded on a lost node (no room before)."""
    return sum(1 for pk in stranded_deployments() if reschedule(pk))


@shared_task(name=RECONCILE_NODE_TASK, ignore_result=True)
def reconcile_node(node_id: int) -> int:
    """A node came back: re-check its deployments that went unknown while it was away."""
    return reconcile_returning_node(node_id)


@shared_task(name="deployments.resume_in_flight", ignore_result=True)
def resume_in_flight() -> int:
    """Nudge every deployment mid-workflow; harmless because advance is idempotent."""
    ids = list(
        Deployment.objects.filter(
            state__in=[DeploymentState.DEPLOYING, DeploymentState.STOPPING]
        ).values_list("pk", flat=True)
    )
    for deployment_id in ids:
        advance_deployment.delay(deployment_id)
    return len(ids)
