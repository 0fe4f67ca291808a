"""Placement against the database: the fleet as the scheduler sees it, the fleet-wide
placement lock, and the cards' claims (the package docstring tells how they fit together)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

from django.db import IntegrityError, connection, transaction

from controlplane.deployments.models import AcceleratorClaim, Deployment
from controlplane.deployments.placement.cores import ACTIVE, node_topology
from controlplane.deployments.placement.fit import PlacementError
from controlplane.deployments.placement.scheduler import (
    GIB,
    CardView,
    Choice,
    Constraints,
    NodeView,
    NoPlacement,
)
from controlplane.deployments.placement.scheduler import choose as choose_node
from controlplane.inventory.cpulist import parse_cpu_list
from controlplane.inventory.models import Accelerator, Node

PLACEMENT_LOCK_KEY = 0x5359_5348  # the advisory lock every placement takes


def constraints_for(deployment: Deployment) -> Constraints:
    profile = deployment.profile
    ports = (profile.gpu_port,) + ((profile.cpu_port,) if profile.enable_cpu_engine else ())
    return Constraints(
        accelerators=profile.tensor_parallel_size,
        accelerator_kind=deployment.accelerator_kind,
        min_device_memory_bytes=int((deployment.min_device_memory_gb or 0) * GIB),
        cpu_engine=profile.enable_cpu_engine,
        cpu_cores=deployment.cpu_cores,
        cpu_numa_local=deployment.cpu_numa_local,
        ports=ports,
        node_selector=dict(deployment.node_selector or {}),
    )


def node_views(
    deployment: Deployment, nodes: list[Node] | None = None, *, free_of_profile: bool = False
) -> list[NodeView]:
    """Each node as the scheduler sees it, leaving out what ``deployment`` itself holds, and
    with ``free_of_profile`` what every deployment of its profile holds (a profile's own fit:
    could a deployment of it run here, were its own deployments not there)."""
    if nodes is None:
        nodes = list(
            Node.objects.select_related("cpu").prefetch_related("accelerators", "numa_nodes")
        )
    others_qs = Deployment.objects.filter(state__in=ACTIVE, node__in=nodes)
    claims = AcceleratorClaim.objects.filter(accelerator__node__in=nodes)
    if deployment.pk is not None:  # a draft being created holds nothing yet
        others_qs = others_qs.exclude(pk=deployment.pk)
        claims = claims.exclude(deployment=deployment)
    if free_of_profile:
        others_qs = others_qs.exclude(profile=deployment.profile)
        claims = claims.exclude(deployment__profile=deployment.profile)
    others = list(others_qs.select_related("profile"))
    claimed = set(claims.values_list("accelerator_id", flat=True))
    ports: dict[int, set[int]] = defaultdict(set)
    held: dict[int, set[int]] = defaultdict(set)
    model = deployment.profile.model_name_for_clients
    same_model: Counter[int] = Counter()
    for other in others:
        ports[other.node_id].add(other.profile.gpu_port)
        if other.profile.enable_cpu_engine:
            ports[other.node_id].add(other.profile.cpu_port)
        held[other.node_id].update(
            parse_cpu_list(str((other.affinity_plan or {}).get("cpuset", "")))
        )
        if other.profile.model_name_for_clients == model:
            same_model[other.node_id] += 1
    views = []
    for node in nodes:
        topology = node_topology(node, exclude=held[node.pk])
        views.append(
            NodeView(
                name=node.name,
                status=node.status,
                labels={str(k): str(v) for k, v in (node.labels or {}).items()},
                cards=tuple(
                    scheduler_card(acc, free=acc.pk not in claimed)
                    for acc in node.accelerators.all()
                ),
                free_cores_per_numa={n.index: len(n.cores) for n in topology.numa_nodes},
                ports_in_use=frozenset(ports[node.pk]),
                same_model_engines=same_model[node.pk],
            )
        )
    return views


def scheduler_card(acc: Accelerator, *, free: bool) -> CardView:
    return CardView(
        uuid=acc.uuid,
        index=acc.index,
        kind=acc.kind,
        memory_bytes=acc.memory_total_bytes,
        free=free,
    )


def _as_pinned(view: NodeView) -> NodeView:
    """A pinned deployment goes to its operator's node whatever the node's heartbeat says (its
    agent may be on its way); only draining refuses it, as check_placement says."""
    return replace(view, status="draining" if view.status == "draining" else "online")


def choose(deployment: Deployment, *, avoid: frozenset[str] = frozenset()) -> Choice:
    """Where ``deployment`` should run now. A pinned one only on its node (which must not be
    draining); a placed one stays on its node while that still fits, else the scheduler's
    choice among the others. Raises PlacementError naming the constraint."""
    wanted = constraints_for(deployment)
    try:
        if deployment.pinned:
            (view,) = node_views(deployment, [deployment.node])
            return choose_node([_as_pinned(view)], wanted)
        views = [v for v in node_views(deployment) if v.name not in avoid]
        # An active deployment stays where it runs while that still fits; one starting now
        # (never deployed, stopped) is placed afresh, so replicas spread.
        here = (
            deployment.node.name
            if deployment.node_id is not None and deployment.state in ACTIVE
            else None
        )
        current = next((v for v in views if v.name == here), None)
        if current is not None:
            try:
                return choose_node([current], wanted)
            except NoPlacement:
                pass
        return choose_node(views, wanted)
    except NoPlacement as exc:
        raise PlacementError(exc.field, exc.message) from None


def _lock_placements() -> None:
    """One placement at a time, fleet-wide, until the caller's transaction ends: a choice is
    made on what every earlier placement committed, and no two deploys lock nodes in opposite
    orders. PostgreSQL: a transaction-scoped advisory lock. SQLite serializes writers itself."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PLACEMENT_LOCK_KEY])


def place_and_claim(
    deployment: Deployment, *, avoid: frozenset[str] = frozenset()
) -> tuple[Choice, bool]:
    """Choose a node and claim its cards, in the caller's transaction (which must be open).
    Returns the choice and whether the deployment moved to another node (its ``node`` is set,
    not saved)."""
    if not connection.in_atomic_block:
        raise RuntimeError("place_and_claim needs the caller's transaction")
    _lock_placements()
    choice = choose(deployment, avoid=avoid)
    node = Node.objects.get(name=choice.node)
    AcceleratorClaim.objects.filter(deployment=deployment).delete()
    cards = list(node.accelerators.filter(uuid__in=choice.cards))
    try:
        with transaction.atomic():
            AcceleratorClaim.objects.bulk_create(
                [AcceleratorClaim(accelerator=acc, deployment=deployment) for acc in cards]
            )
    except IntegrityError:  # a writer that bypassed the lock took a card first
        raise PlacementError(
            "tensor_parallel_size", f"a card of node {node.name!r} was taken meanwhile; retry"
        ) from None
    moved = node.pk != deployment.node_id
    deployment.node = node
    return choice, moved


def release(deployment: Deployment) -> None:
    """The deployment holds no cards any more (stopped, failed or moving)."""
    AcceleratorClaim.objects.filter(deployment=deployment).delete()
