"""Deployment operations. Each runs in one transaction, writes a timeline event and an audit
row, and queues the workflow task only after the transaction commits. Deletes of profiles and
deployments are here too: the API, the admin and the workflow all delete through them."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Q

from controlplane.core import audit, dispatch, tracing
from controlplane.core.actors import Actor
from controlplane.core.services import DeleteRefused, audited_delete
from controlplane.deployments import delivery
from controlplane.deployments.choices import (
    ADVANCE_TASK,
    DEPLOYMENT_LIFECYCLE,
    RESCHEDULE_TASK,
    CommandAction,
    CommandStatus,
    DeploymentAuditAction,
    DeploymentState,
    DesiredState,
    EventLevel,
)
from controlplane.deployments.models import (
    AgentCommand,
    ContainerInstance,
    Deployment,
    DeploymentEvent,
    DeploymentProfile,
)
from controlplane.deployments.placement import (
    Choice,
    PlacementError,
    choose,
    place_and_claim,
    placement_plan,
    release,
)
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
        detail=tracing.with_trace_id(detail or {}),  # the dashboard links it to the viewer
    )


def set_state(deployment: Deployment, state: str, reason: str = "") -> None:
    """The deployment's state moves (checked against its table); cards free once it stops."""
    deployment.transition(state, reason)
    if state in (DeploymentState.STOPPED, DeploymentState.FAILED) and deployment.pk:
        release(deployment)  # its cards are free for the next placement


def _queue_advance(deployment_id: int) -> None:
    dispatch.enqueue(ADVANCE_TASK, deployment_id)


PLACEMENT_FIELDS = (
    "accelerator_kind",
    "min_device_memory_gb",
    "cpu_cores",
    "cpu_numa_local",
    "node_selector",
)


def create_deployment(
    *,
    name: str,
    profile: DeploymentProfile,
    node: Node | None,
    policy: SchedulingPolicy | None = None,
    acting_user: Actor,
    start: bool = False,
    replicas: int = 1,
    **placement: Any,
) -> Deployment:
    """A deployment of ``profile`` on ``node``, or, with ``node=None``, on the node the
    scheduler chooses within the ``placement`` constraints (PLACEMENT_FIELDS), with
    ``replicas`` engine pairs (replicas 2..N are placed by the scheduler)."""
    unknown = set(placement) - set(PLACEMENT_FIELDS)
    if unknown:
        raise TypeError(f"unknown placement constraint(s): {', '.join(sorted(unknown))}")
    draft = Deployment(
        name=name, profile=profile, pinned=node is not None, replicas=replicas, **placement
    )
    how = "pinned by its operator"
    if node is None:
        how = f"chosen by the scheduler ({_place_draft(draft).reason})"
    else:
        draft.node = node
        draft.affinity_plan = placement_plan(profile, node, draft)
    node = draft.node
    user, _ = audit.split_actor(acting_user)
    with transaction.atomic(durable=True):
        draft.policy = policy or ensure_default_policy()
        draft.created_by = user
        draft.save(force_insert=True)
        deployment = draft
        add_event(
            deployment, "created", f"profile {profile.name} placed on node {node.name}, {how}"
        )
        audit.record(DeploymentAuditAction.DEPLOYMENT_CREATED, deployment, acting_user=acting_user)
        _sync_replicas(deployment, acting_user=acting_user)
        if start:
            request_deploy(deployment, acting_user=acting_user)
    return deployment


def _place_draft(draft: Deployment) -> Choice:
    """A deployment not yet saved, on the node the scheduler chooses, its CPU engine planned
    there (nothing claimed: cards are claimed when it deploys)."""
    choice = choose(draft)
    draft.node = Node.objects.get(name=choice.node)
    draft.affinity_plan = placement_plan(draft.profile, draft.node, draft)
    return choice


def replica_name(first: Deployment, index: int) -> str:
    return f"{first.name[:58]}-r{index}"


def _sync_replicas(first: Deployment, *, acting_user: Actor) -> None:
    """Replicas 2..N of ``first`` exist, inherit its profile, policy and constraints, and
    those beyond N retire (stopped, then removed). Runs in the caller's transaction."""
    have = {r.replica_index: r for r in first.replica_set.all()}
    for index in range(2, first.replicas + 1):
        replica = have.get(index)
        if replica is not None:
            if replica.retiring:
                replica.retiring = False
                replica.save(update_fields=["retiring", "updated_at"])
            continue
        replica = Deployment(
            name=replica_name(first, index),
            profile=first.profile,
            policy=first.policy,
            pinned=False,
            replica_of=first,
            replica_index=index,
            created_by=first.created_by,
            **{f: getattr(first, f) for f in PLACEMENT_FIELDS},
        )
        choice = _place_draft(replica)
        replica.save(force_insert=True)
        add_event(
            replica,
            "created",
            f"replica {index} of {first.name}, placed on node {replica.node.name} "
            f"({choice.reason})",
        )
        audit.record(DeploymentAuditAction.DEPLOYMENT_CREATED, replica, acting_user=acting_user)
    for index, replica in have.items():
        if index > first.replicas and not replica.retiring:
            replica.retiring = True
            replica.save(update_fields=["retiring", "updated_at"])
            if replica.state in (DeploymentState.STOPPED, DeploymentState.PENDING):
                retire_replica(replica, acting_user=acting_user)
            else:
                request_stop(replica, acting_user=acting_user)


def set_replicas(first: Deployment, replicas: int, *, acting_user: Actor) -> Deployment:
    """Change the replica count; new replicas deploy at once when the deployment should run."""
    with transaction.atomic(durable=True):
        locked = Deployment.objects.select_for_update().get(pk=first.pk)
        if locked.replica_of_id is not None:
            raise PlacementError("replicas", "set the count on the first replica")
        locked.replicas = replicas
        locked.save(update_fields=["replicas", "updated_at"])
        _sync_replicas(locked, acting_user=acting_user)
        if locked.desired_state == DesiredState.RUNNING:
            for replica in locked.replica_set.filter(retiring=False).exclude(
                desired_state=DesiredState.RUNNING
            ):
                request_deploy(replica, acting_user=acting_user, follow=False)
        audit.record(
            DeploymentAuditAction.DEPLOYMENT_REPLICAS,
            locked,
            acting_user=acting_user,
            detail={"replicas": replicas},
        )
    first.refresh_from_db()
    return first


def request_deploy(
    deployment: Deployment, *, acting_user: Actor, follow: bool = True
) -> Deployment:
    """Start (or redeploy after a profile change): a new generation, GPU first then CPU; the
    deployment's other replicas too (``follow``), all placed or none."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        _place(locked)
        _begin_generation(locked, "deploy requested")
        add_event(locked, "deploy", f"deploy of generation {locked.generation} requested")
        audit.record(
            DeploymentAuditAction.DEPLOYMENT_DEPLOY,
            locked,
            acting_user=acting_user,
            detail={"generation": locked.generation},
        )
        if follow:  # after the first replica, which keeps its node; the others spread
            for replica in locked.replica_set.filter(retiring=False).order_by("replica_index"):
                try:
                    request_deploy(replica, acting_user=acting_user, follow=False)
                except PlacementError as exc:
                    raise PlacementError(
                        exc.field, f"replica {replica.replica_index}: {exc.message}"
                    ) from None
    deployment.refresh_from_db()
    return deployment


def _begin_generation(locked: Deployment, reason: str) -> None:
    """A new generation of the (locked, placed) deployment starts deploying, GPU first."""
    locked.generation += 1
    locked.desired_state = DesiredState.RUNNING
    locked.step = ""
    set_state(locked, DeploymentState.DEPLOYING, reason)
    locked.save()
    _queue_advance(locked.pk)


def _place(locked: Deployment, *, avoid: frozenset[str] = frozenset()) -> str:
    """Claim the deployment's cards (moving it when it is not pinned and its node no longer
    fits) and plan its CPU engine there. Returns the node it left, or ""."""
    before = locked.node
    choice, moved = place_and_claim(locked, avoid=avoid)
    locked.affinity_plan = placement_plan(
        locked.profile, locked.node, locked, numa_node=choice.numa_node
    )
    if moved:
        add_event(locked, "placed", f"placed on node {locked.node.name}: {choice.reason}")
        return before.name
    return ""


def request_stop(deployment: Deployment, *, acting_user: Actor, follow: bool = True) -> Deployment:
    with transaction.atomic():
        if follow:
            for replica in deployment.replica_set.all():
                request_stop(replica, acting_user=acting_user, follow=False)
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.desired_state == DesiredState.STOPPED and locked.state == DeploymentState.STOPPED:
            return locked
        locked.desired_state = DesiredState.STOPPED
        locked.step = ""
        set_state(locked, DeploymentState.STOPPING, "stop requested")
        locked.save()
        add_event(locked, "stop", "stop requested")
        audit.record(DeploymentAuditAction.DEPLOYMENT_STOP, locked, acting_user=acting_user)
        _queue_advance(locked.pk)
    deployment.refresh_from_db()
    return deployment


def request_restart(deployment: Deployment, *, acting_user: Actor) -> Deployment:
    """A restart is a redeploy of the same profile: old engines stop, a new generation starts."""
    return request_deploy(deployment, acting_user=acting_user)


# A deployment is deleted only in these states: in every other one its engines may still run
# on its node, holding the cards it claims (docs/lifecycles.md, "Deleting"). Stopped and failed
# ones have freed their cards; pending ones never claimed any.
DELETABLE_STATES = (DeploymentState.STOPPED, DeploymentState.PENDING, DeploymentState.FAILED)


def _engines_may_run(deployment: Deployment) -> str:
    """Why the deployment's engines may still run, or ""."""
    if deployment.state not in DELETABLE_STATES:
        return f"is {deployment.state}; stop it first"
    if deployment.state == DeploymentState.FAILED and deployment.step:
        # Its cleanup commands are still out: deleting them would orphan what started.
        return (
            f"is failed and still removing its engines (step {deployment.step}); "
            "delete it once that is done"
        )
    return ""


def deployment_delete_refusal(deployment: Deployment) -> str:
    """Why the deployment may not be deleted now, or "". Its replicas go with it, so they
    count too; and a benchmark run measured only through it would lose its target."""
    for member in (deployment, *deployment.replica_set.order_by("replica_index")):
        why = _engines_may_run(member)
        if why:
            who = "it" if member.pk == deployment.pk else f"its replica {member.name!r}"
            return (
                f"cannot delete deployment {deployment.name!r} while its engines may run: "
                f"{who} {why}"
            )
    runs = deployment.benchmark_runs.filter(target_url="").count()
    if runs:
        return (
            f"deployment {deployment.name!r} is the only target of {runs} benchmark "
            f"run{'s' if runs > 1 else ''}: delete those first to keep no orphaned results"
        )
    return ""


def delete_deployment(deployment: Deployment, *, acting_user: Actor) -> None:
    """Delete the deployment and its replicas, with an audit row; raises DeleteRefused
    (naming the state) while any of their engines may still run, so a delete never frees the
    cards of engines that run."""
    with transaction.atomic():
        # Locked with its replicas: a deploy of any of them waits, then finds it gone.
        locked = list(
            Deployment.objects.select_for_update()
            .filter(Q(pk=deployment.pk) | Q(replica_of=deployment.pk))
            .order_by("pk")
        )
        first = next((d for d in locked if d.pk == deployment.pk), None)
        if first is None:  # deleted meanwhile
            return
        why = deployment_delete_refusal(first)
        if why:
            raise DeleteRefused(why)
        detail = {"state": first.state, "node": first.node.name, "profile": first.profile.name}
        replicas = sorted(d.name for d in locked if d.pk != first.pk)
        if replicas:
            detail["replicas"] = ", ".join(replicas)
        audited_delete(
            first, DeploymentAuditAction.DEPLOYMENT_DELETED, acting_user=acting_user, detail=detail
        )


def retire_replica(replica: Deployment, *, acting_user: Actor) -> None:
    """A replica beyond its deployment's count, its engines stopped, is deleted; one a rule
    keeps (a benchmark run measured only through it) stays, retiring, and says why."""
    try:
        delete_deployment(replica, acting_user=acting_user)
    except DeleteRefused as exc:
        add_event(replica, "retire", f"kept: {exc}", level=EventLevel.WARNING)


def save_profile(
    profile: DeploymentProfile | None, values: dict[str, Any], *, acting_user: Actor
) -> DeploymentProfile:
    """Create a profile from ``values`` (``profile`` None) or change ``profile`` to them, with
    an audit row naming the fields that changed (not their values: an env may hold a token).
    ``values`` are already validated (the API's ``ProfileSerializer``). A running deployment
    keeps its engines until its next deploy, which starts them from the profile as it is then."""
    created = profile is None
    target = DeploymentProfile() if profile is None else profile
    changed = sorted(k for k, v in values.items() if created or getattr(target, k) != v)
    for field, value in values.items():
        setattr(target, field, value)
    with transaction.atomic(durable=True):
        target.save()
        audit.record(
            DeploymentAuditAction.PROFILE_CREATED
            if created
            else DeploymentAuditAction.PROFILE_UPDATED,
            target,
            acting_user=acting_user,
            detail={"name": target.name, "fields": changed},
        )
    return target


def delete_profile(profile: DeploymentProfile, *, acting_user: Actor) -> None:
    """Delete the profile, with an audit row. One a deployment uses is refused by its
    protected key (ProtectedError: the API's 409 naming them), so no running engines lose it."""
    audited_delete(profile, DeploymentAuditAction.PROFILE_DELETED, acting_user=acting_user)


def mark_node_deployments_unknown(node: Node) -> int:
    """The node was lost: its deployments become unknown, and those the control plane placed
    are placed again elsewhere (after commit, one task each)."""
    changed = 0
    # Locked: a workflow step recorded at the same moment must not be overwritten, nor
    # overwrite this. Only states the table lets go to unknown are touched.
    for deployment in Deployment.objects.select_for_update().filter(
        node=node, state__in=DEPLOYMENT_LIFECYCLE.sources(DeploymentState.UNKNOWN)
    ):
        set_state(deployment, DeploymentState.UNKNOWN, f"node {node.name} stopped heartbeating")
        audit.record(
            DeploymentAuditAction.DEPLOYMENT_UNKNOWN,
            deployment,
            acting_user="reaper",
            detail={"node": node.name},
        )
        deployment.save(update_fields=["state", "state_reason", "state_changed_at", "updated_at"])
        add_event(deployment, "node-lost", deployment.state_reason, level=EventLevel.WARNING)
        if not deployment.pinned and deployment.desired_state == DesiredState.RUNNING:
            _queue_reschedule(deployment.pk)
        changed += 1
    return changed


def _queue_reschedule(deployment_id: int) -> None:
    dispatch.enqueue(RESCHEDULE_TASK, deployment_id)


def stranded_deployments() -> list[int]:
    """Placed (not pinned) deployments that should run but sit on a lost node."""
    return list(
        Deployment.objects.filter(
            pinned=False,
            desired_state=DesiredState.RUNNING,
            state=DeploymentState.UNKNOWN,
        )
        .exclude(node__status="online")
        .values_list("pk", flat=True)
    )


def reschedule(deployment_id: int) -> str:
    """Place a stranded deployment on another node and deploy it there; with no room, say why
    in its state reason (beat tries again). Returns the node it went to, or ""."""
    with transaction.atomic(durable=True):
        locked = (
            Deployment.objects.select_for_update()
            .select_related("profile", "node")
            .get(pk=deployment_id)
        )
        lost = locked.node
        if (
            locked.pinned
            or locked.desired_state != DesiredState.RUNNING
            or locked.state != DeploymentState.UNKNOWN
            or lost.status == "online"
        ):
            return ""
        try:
            _place(locked, avoid=frozenset({lost.name}))
        except PlacementError as exc:
            reason = f"node {lost.name} lost; no other node has room: {exc}"
            if reason != locked.state_reason:
                locked.state_reason = reason
                locked.save(update_fields=["state_reason", "updated_at"])
                add_event(locked, "reschedule", reason, level=EventLevel.WARNING)
            return ""
        reason = f"node {lost.name} lost; placed again on node {locked.node.name}"
        _begin_generation(locked, reason)
        add_event(locked, "reschedule", reason, level=EventLevel.WARNING)
        audit.record(
            DeploymentAuditAction.DEPLOYMENT_RESCHEDULED,
            locked,
            acting_user="scheduler",
            detail={"from": lost.name, "to": locked.node.name, "generation": locked.generation},
        )
        return locked.node.name


def stop_moved_away(node: Node, deployment_ids: set[int]) -> int:
    """Engines a returning node still runs for deployments placed elsewhere since: one stop
    command each (all generations), unless one is already queued."""
    issued = 0
    for deployment in Deployment.objects.filter(pk__in=deployment_ids).exclude(node=node):
        pending = AgentCommand.objects.filter(
            node=node, deployment=deployment, action=CommandAction.STOP, step=""
        ).filter(status=CommandStatus.QUEUED)
        if pending.exists():
            continue
        command = AgentCommand.objects.create(
            node=node,
            deployment=deployment,
            action=CommandAction.STOP,
            generation=deployment.generation,
            spec={
                "deployment": deployment.name,
                "deployment_id": deployment.pk,
                "role": None,
                "keep_generation": None,
            },
        )
        add_event(
            deployment,
            "orphans",
            f"node {node.name} is back with engines of this deployment, which now runs on "
            f"node {deployment.node.name}: stopping them there",
            level=EventLevel.WARNING,
            detail={"dispatch_id": str(command.dispatch_id)},
        )
        transaction.on_commit(lambda: delivery.wake(node.pk))
        issued += 1
    return issued


def _audit_container(container: ContainerInstance, was: str | None, actor: str) -> None:
    """One audit row per container whose status changed (not one per report)."""
    audit.record(
        DeploymentAuditAction.CONTAINER_STATUS,
        container,
        acting_user=actor,
        detail={
            "deployment": container.deployment_id,
            "role": container.role,
            "generation": container.generation,
            "from": was,
            "to": container.status,
        },
    )


def sync_containers(node: Node, reported: list[dict[str, Any]]) -> int:
    """Store the containers an agent sees, then settle deployments left unknown."""

    updated = 0
    actor = f"agent:{node.name}"
    with transaction.atomic(durable=True):
        own = {d.pk: d for d in Deployment.objects.filter(node=node)}
        # One read of the node's containers: their statuses before this report (for the
        # audit) and, for those it no longer names, the rows to mark missing.
        known = {
            (c.deployment_id, c.role, c.generation): c
            for c in ContainerInstance.objects.filter(deployment__node=node)
        }
        elsewhere = {
            int(i["deployment_id"])
            for i in reported
            if i["deployment_id"] not in own and i.get("status") != "missing"
        }
        if elsewhere:
            stop_moved_away(node, elsewhere)
        for item in reported:
            deployment = own.get(item["deployment_id"])
            if deployment is None:
                continue
            container, _ = ContainerInstance.objects.update_or_create(
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
            previous = known.get((deployment.pk, container.role, container.generation))
            was = previous.status if previous is not None else None
            if was != container.status:
                _audit_container(container, was, actor)
        seen = {(i["deployment_id"], i["role"], i["generation"]) for i in reported}
        for key, container in known.items():
            if key not in seen and container.status != "missing":
                was = container.status
                container.status = "missing"
                container.save(update_fields=["status", "updated_at"])
                _audit_container(container, was, actor)
    reconcile_returning_node(node.pk)
    return updated


def reconcile_returning_node(node_id: int) -> int:
    """Settle the node's unknown deployments from the containers its agent last reported."""

    settled = 0
    for deployment in Deployment.objects.filter(node_id=node_id, state=DeploymentState.UNKNOWN):
        with transaction.atomic(durable=True):
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
            elif locked.step:
                # Lost in the middle of its workflow: carry on from the step it waited on
                # (its command is still queued for the agent, or done and recorded).
                resumed = (
                    DeploymentState.DEPLOYING
                    if locked.desired_state == DesiredState.RUNNING
                    else DeploymentState.STOPPING
                )
                set_state(locked, resumed, f"node is back; resuming at {locked.step}")
                locked.save()
                add_event(locked, "node-back", locked.state_reason)
                _queue_advance(locked.pk)
            else:
                continue
            settled += 1
    return settled


__all__ = [
    "PlacementError",
    "add_event",
    "create_deployment",
    "delete_deployment",
    "delete_profile",
    "mark_node_deployments_unknown",
    "request_deploy",
    "request_restart",
    "request_stop",
    "save_profile",
]
