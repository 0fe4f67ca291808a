"""The node page's CPU picture: sockets, NUMA nodes, cores and which engine holds each core.

Pure functions over plain values (no queries), so the layout is trivial to test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from controlplane.inventory.cpulist import CpuListError, parse_cpu_list

# Enough distinct colours for the engines of one node; more holders reuse them in turn.
PALETTE_SIZE = 6


@dataclass(frozen=True)
class Holder:
    """An engine that holds cores: ``cpuset`` is a Linux CPU list from the affinity plan."""

    label: str
    cpuset: str
    url: str = ""


@dataclass
class Core:
    cpu: int
    holders: list[int] = field(default_factory=list)  # indexes into Topology.holders
    labels: list[str] = field(default_factory=list)

    @property
    def colour(self) -> int | None:
        return self.holders[0] % PALETTE_SIZE if self.holders else None

    @property
    def shared(self) -> bool:
        return len(self.holders) > 1


@dataclass
class NumaBlock:
    index: int
    cores: list[Core]
    memory_gb: float

    @property
    def held(self) -> int:
        return sum(1 for core in self.cores if core.holders)


@dataclass
class Socket:
    index: int
    numa: list[NumaBlock]


@dataclass
class HolderView:
    label: str
    cpuset: str
    url: str
    colour: int
    cores: int
    error: str = ""


@dataclass
class Topology:
    sockets: list[Socket]
    holders: list[HolderView]
    unplaced: list[int]  # held CPUs the node did not report (a stale plan)

    @property
    def cpu_count(self) -> int:
        return sum(len(n.cores) for s in self.sockets for n in s.numa)

    @property
    def numa_memory_gb(self) -> float:
        """The memory of the NUMA nodes shown (each one's own, as the kernel assigns it)."""
        return sum(n.memory_gb for s in self.sockets for n in s.numa)

    def memory_unaccounted_gb(self, node_total_bytes: int) -> float:
        """The node's memory its NUMA nodes with CPUs do not hold (memory-only NUMA nodes,
        or memory the kernel does not assign per NUMA node); 0 when they agree within 5 %."""
        total = node_total_bytes / 1024**3
        missing = total - self.numa_memory_gb
        return missing if total and missing > 0.05 * total else 0.0


def build_topology(
    numa_nodes: Sequence[tuple[int, str, int]], sockets: int, holders: Sequence[Holder]
) -> Topology:
    """Lay out ``numa_nodes`` ((index, cpu list, memory bytes)) over ``sockets``.

    Linux reports NUMA nodes but not which socket holds each, so NUMA nodes are split evenly
    over the sockets in index order (how every common server numbers them).
    """
    blocks: list[NumaBlock] = []
    by_cpu: dict[int, Core] = {}
    for index, cpus, memory in sorted(numa_nodes):
        try:
            ids = parse_cpu_list(cpus)
        except CpuListError:
            ids = []
        cores = [Core(cpu) for cpu in ids]
        by_cpu.update((core.cpu, core) for core in cores)
        blocks.append(NumaBlock(index=index, cores=cores, memory_gb=memory / 1024**3))
    views: list[HolderView] = []
    unplaced: set[int] = set()
    for position, holder in enumerate(holders):
        view = HolderView(holder.label, holder.cpuset, holder.url, position % PALETTE_SIZE, 0)
        try:
            wanted = parse_cpu_list(holder.cpuset) if holder.cpuset else []
        except CpuListError as exc:
            view.error = str(exc)
            wanted = []
        for cpu in wanted:
            core = by_cpu.get(cpu)
            if core is None:
                unplaced.add(cpu)
                continue
            core.holders.append(position)
            core.labels.append(holder.label)
            view.cores += 1
        views.append(view)
    socket_count = max(1, sockets)
    per_socket = max(1, math.ceil(len(blocks) / socket_count)) if blocks else 1
    layout = [
        Socket(index=i, numa=blocks[i * per_socket : (i + 1) * per_socket])
        for i in range(socket_count)
    ]
    return Topology(sockets=layout, holders=views, unplaced=sorted(unplaced))
