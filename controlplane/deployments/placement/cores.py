"""Plan the CPU engine's cores on a node with the agents' pure planner (common.affinity),
leaving out cores that other active deployments on the node already hold; and
:func:`placement_plan`, the fit check and that plan together, as a deployment stores it."""

from __future__ import annotations

from typing import Any

from common.affinity import (
    AffinityError,
    AffinityRequest,
    Topology,
    plan_affinity,
    topology_from_inventory,
)
from controlplane.deployments.choices import AffinityMode, DeploymentState
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.deployments.placement.fit import PlacementError, check_placement
from controlplane.inventory.cpulist import format_cpu_list, parse_cpu_list
from controlplane.inventory.models import Node

ACTIVE = (DeploymentState.DEPLOYING, DeploymentState.RUNNING, DeploymentState.UNKNOWN)


def node_topology(node: Node, exclude: set[int] | None = None) -> Topology:
    """The node's NUMA layout as the planner wants it, without the CPUs in ``exclude``."""
    cpu = getattr(node, "cpu", None)
    return topology_from_inventory(
        [{"index": n.index, "cpus": n.cpus} for n in node.numa_nodes.all() if n.cpus.strip()],
        physical_cores=cpu.physical_cores if cpu is not None else 0,
        threads=cpu.threads if cpu is not None else 0,
        exclude=exclude or (),
    )


def held_cpus(
    node: Node,
    *,
    excluding: Deployment | None = None,
    excluding_profile: DeploymentProfile | None = None,
) -> dict[int, str]:
    """CPU -> the name of the active deployment on the node whose CPU engine holds it, leaving
    out ``excluding`` and every deployment of ``excluding_profile``."""
    held: dict[int, str] = {}
    others = Deployment.objects.filter(node=node, state__in=ACTIVE)
    if excluding is not None and excluding.pk is not None:
        others = others.exclude(pk=excluding.pk)
    if excluding_profile is not None and excluding_profile.pk is not None:
        others = others.exclude(profile=excluding_profile)
    for other in others:
        for cpu in parse_cpu_list(str((other.affinity_plan or {}).get("cpuset", ""))):
            held[cpu] = other.name
    return held


def plan_for(
    profile: DeploymentProfile,
    node: Node,
    *,
    deployment: Deployment | None = None,
    cpu_cores: int | None = None,
    numa_nodes: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The CPU engine's cpuset, OMP_NUM_THREADS and CUSTOM_CPU_AFFINITY, as stored on the
    deployment. Raises PlacementError naming the field when it cannot be placed.

    Without a ``deployment`` the question is the profile's own (its page, ``syshax profile
    render``): what a deployment of it would get here, so the cores its own active deployments
    hold count as free. A deployment being created passes its draft, and then they count."""
    held = held_cpus(
        node, excluding=deployment, excluding_profile=profile if deployment is None else None
    )
    explicit = profile.cpu_affinity_mode == AffinityMode.EXPLICIT
    if explicit:
        clash = sorted(set(parse_cpu_list(profile.cpu_affinity)) & set(held))
        if clash:
            raise PlacementError(
                "cpu_affinity",
                f"CPUs {format_cpu_list(clash)} are held by deployment {held[clash[0]]!r}",
            )
    topology = node_topology(node, exclude=set(held))
    if not topology.numa_nodes:
        raise PlacementError(
            "cpu_affinity",
            f"node {node.name!r} has no free CPU cores"
            + (f" (held by {', '.join(sorted(set(held.values())))})" if held else ""),
        )
    tp = profile.tensor_parallel_size
    # Keep two cores per GPU engine process for its host threads, on nodes big enough to spare them.
    gpu_host = min(2 * tp, topology.physical_cores // 4)
    request = AffinityRequest(
        cpu_cores=None if explicit else cpu_cores,
        gpu_host_cores=0 if explicit else gpu_host,
        numa_nodes=None if explicit else numa_nodes,
        cpu_affinity=profile.cpu_affinity if explicit else None,
    )
    try:
        plan = plan_affinity(topology, request)
    except AffinityError as exc:
        raise PlacementError(exc.field, exc.message) from None
    omp = plan.omp_num_threads
    if profile.omp_num_threads:
        low, high = plan.physical_cores, int(plan.physical_cores * 1.5)
        if not low <= profile.omp_num_threads <= high:
            raise PlacementError(
                "omp_num_threads",
                f"is {profile.omp_num_threads}; with {plan.physical_cores} physical cores it "
                f"must be between {low} and {high} (1-1.5x the cores)",
            )
        omp = profile.omp_num_threads
    return {
        "cpuset": plan.cpuset,
        "physical_cores": plan.physical_cores,
        "omp_num_threads": omp,
        "custom_cpu_affinity": plan.custom_cpu_affinity,
        "gpu_cpuset": plan.gpu_host_cpuset,
        "cores_per_numa_node": {str(k): v for k, v in plan.cores_per_numa_node.items()},
    }


def placement_plan(
    profile: DeploymentProfile,
    node: Node,
    deployment: Deployment | None = None,
    *,
    numa_node: int | None = None,
) -> dict[str, Any]:
    """Check the profile fits the node and plan the CPU engine's cores (on ``numa_node`` only
    when given); raise the first PlacementError (it names the field and the limit), carrying
    all of them in ``problems``."""
    problems = check_placement(profile, node)
    if problems:
        first = problems[0]
        first.problems = problems
        raise first
    if not profile.enable_cpu_engine:
        return {}

    return plan_for(
        profile,
        node,
        deployment=deployment,
        cpu_cores=deployment.cpu_cores if deployment is not None else None,
        numa_nodes=(numa_node,) if numa_node is not None else None,
    )
