"""Does a profile fit a node? Pure checks over already-loaded rows; no writes."""

from __future__ import annotations

from common.errors import FieldError
from controlplane.deployments.choices import AffinityMode
from controlplane.deployments.models import DeploymentProfile
from controlplane.inventory.cpulist import CpuListError, format_cpu_list, parse_cpu_list
from controlplane.inventory.models import Node

# sysHAX's deployment guide: at least 20 GB of device memory per card.
MIN_ACCELERATOR_MEMORY_GB = 20.0


class PlacementError(FieldError):
    """The profile does not fit the node.

    ``problems`` holds every reason found by the same check (this error first), so a caller
    that shows them all need not run the check again; a lone error holds only itself."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.problems: list[PlacementError] = [self]


def check_placement(profile: DeploymentProfile, node: Node) -> list[PlacementError]:
    """Every reason the profile cannot run on the node (empty when it fits)."""
    problems: list[PlacementError] = []
    if node.status == "draining":
        problems.append(PlacementError("node", f"node {node.name!r} is draining"))
    accelerators = list(node.accelerators.all())
    tp = profile.tensor_parallel_size
    if tp > len(accelerators):
        problems.append(
            PlacementError(
                "tensor_parallel_size",
                f"is {tp} but node {node.name!r} has {len(accelerators)} accelerator(s)",
            )
        )
    else:
        small = [a for a in accelerators[:tp] if a.memory_total_gb < MIN_ACCELERATOR_MEMORY_GB]
        for acc in small:
            problems.append(
                PlacementError(
                    "tensor_parallel_size",
                    f"accelerator {acc.index} of node {node.name!r} has "
                    f"{acc.memory_total_gb:.1f} GB; each card needs at least "
                    f"{MIN_ACCELERATOR_MEMORY_GB:.0f} GB",
                )
            )
    if profile.enable_cpu_engine and profile.cpu_affinity_mode == AffinityMode.EXPLICIT:
        node_cores = set(node.core_ids())
        try:
            wanted = set(parse_cpu_list(profile.cpu_affinity))
        except CpuListError as exc:
            problems.append(PlacementError("cpu_affinity", str(exc)))
        else:
            if not node_cores:
                problems.append(
                    PlacementError(
                        "cpu_affinity", f"node {node.name!r} has not reported its CPU topology yet"
                    )
                )
            elif outside := wanted - node_cores:
                problems.append(
                    PlacementError(
                        "cpu_affinity",
                        f"CPUs {format_cpu_list(outside)} are outside node {node.name!r}'s "
                        f"cores {format_cpu_list(node_cores)}",
                    )
                )
    return problems
