"""NUMA-aware CPU affinity planning for the CPU inference engine.

A pure function (no I/O) from a node's topology and a profile's CPU request to the cpuset,
``OMP_NUM_THREADS`` and thread binding (``VLLM_CPU_OMP_THREADS_BIND``, or sysHAX's
``CUSTOM_CPU_AFFINITY``) of the CPU engine, following sysHAX's guidance:

* OpenMP threads are 1-1.5x the physical cores given to the engine;
* the cores are spread evenly over the NUMA nodes, so every node's memory bandwidth is used and
  each thread reads its local memory;
* a few cores are kept back for the GPU engine's host threads (scheduler, tokenizer, CUDA
  launch), which otherwise compete with decode threads and slow prefill.

The control plane imports this module for placement checks, so it depends on nothing but the
standard library (and the project's shared ``FieldError``) and speaks plain dataclasses.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from common.errors import FieldError

MIN_THREAD_RATIO = 1.0
MAX_THREAD_RATIO = 1.5


class AffinityError(FieldError):
    """A request that cannot be placed on the node; ``field`` names the offending input."""


@dataclass(frozen=True)
class Core:
    """One physical core and the logical CPUs (hardware threads) it runs."""

    cpus: tuple[int, ...]


@dataclass(frozen=True)
class NumaNode:
    index: int
    cores: tuple[Core, ...]

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for core in self.cores for cpu in core.cpus))


@dataclass(frozen=True)
class Topology:
    numa_nodes: tuple[NumaNode, ...]

    @property
    def physical_cores(self) -> int:
        return sum(len(node.cores) for node in self.numa_nodes)

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for node in self.numa_nodes for cpu in node.cpus))

    @classmethod
    def uniform(cls, numa_nodes: int, cores_per_node: int, threads_per_core: int = 1) -> Topology:
        """A symmetric topology numbered the way Linux numbers x86 and Kunpeng servers.

        First hardware threads of all cores come first, node by node (0..N-1); the SMT siblings
        follow in the same order (N..2N-1), so on a 2x56-core SMT2 machine core 0 is CPUs 0 and
        112.
        """
        total = numa_nodes * cores_per_node
        nodes = []
        for n in range(numa_nodes):
            cores = []
            for c in range(cores_per_node):
                first = n * cores_per_node + c
                cores.append(Core(tuple(first + t * total for t in range(threads_per_core))))
            nodes.append(NumaNode(n, tuple(cores)))
        return cls(tuple(nodes))

    @classmethod
    def from_cpu_map(
        cls, node_cpus: Mapping[int, Sequence[int]], core_of: Mapping[int, int]
    ) -> Topology:
        """Build from NUMA node -> CPUs and CPU -> core key (e.g. (package, core_id) hashed)."""
        nodes = []
        for index in sorted(node_cpus):
            by_core: dict[int, list[int]] = {}
            for cpu in sorted(node_cpus[index]):
                by_core.setdefault(core_of.get(cpu, -1 - cpu), []).append(cpu)
            cores = sorted((tuple(sorted(c)) for c in by_core.values()), key=lambda c: c[0])
            nodes.append(NumaNode(index, tuple(Core(c) for c in cores)))
        return cls(tuple(nodes))


def topology_from_inventory(
    numa_nodes: Sequence[Mapping[str, object]],
    *,
    physical_cores: int,
    threads: int,
    exclude: Collection[int] = (),
) -> Topology:
    """Rebuild a :class:`Topology` from the inventory of docs/machine-api.md.

    The inventory lists each NUMA node's CPUs but not which CPUs are SMT siblings, so this
    assumes Linux's numbering on x86 and Kunpeng servers: with N physical cores and 2N threads,
    CPU c and CPU c+N are one core. Without SMT (threads == cores) every CPU is a core.
    CPUs in ``exclude`` (held by other engines) are left out, and so are NUMA nodes left empty.
    """
    smt = threads // physical_cores if physical_cores and threads > physical_cores else 1
    held = set(exclude)
    node_cpus = {
        int(str(n["index"])): [
            cpu
            for cpu in parse_cpu_list(str(n["cpus"]), field_name="numa_nodes.cpus")
            if cpu not in held
        ]
        for n in numa_nodes
    }
    node_cpus = {index: cpus for index, cpus in node_cpus.items() if cpus}
    core_of = {
        cpu: cpu % physical_cores if smt > 1 else cpu for cpus in node_cpus.values() for cpu in cpus
    }
    return Topology.from_cpu_map(node_cpus, core_of)


@dataclass(frozen=True)
class AffinityRequest:
    """What a profile asks of the CPU engine.

    ``cpu_cores``: physical cores for the CPU engine; None takes every core not reserved.
    ``thread_ratio``: OMP threads per physical core, 1.0-1.5.
    ``gpu_host_cores``: physical cores kept for the GPU engine's host threads (0 without a GPU
    engine), taken from ``gpu_numa_node`` (the node the accelerator hangs off).
    ``numa_nodes``: restrict the CPU engine to these nodes; None uses all.
    ``cpu_affinity``: an explicit CPU list (``"0-39,80-119"``) overriding the spread.
    """

    cpu_cores: int | None = None
    thread_ratio: float = 1.0
    gpu_host_cores: int = 0
    gpu_numa_node: int = 0
    numa_nodes: tuple[int, ...] | None = None
    cpu_affinity: str | None = None


@dataclass(frozen=True)
class AffinityPlan:
    cpus: tuple[int, ...]  # logical CPUs of the CPU engine (its cpuset)
    physical_cores: int
    omp_num_threads: int
    custom_cpu_affinity: str  # the CPUs threads bind to, one range group per NUMA node
    gpu_host_cpus: tuple[int, ...]
    cores_per_numa_node: dict[int, int] = field(default_factory=dict)

    @property
    def cpuset(self) -> str:
        return format_cpu_list(self.cpus)

    @property
    def gpu_host_cpuset(self) -> str:
        return format_cpu_list(self.gpu_host_cpus)

    def env(self, engine: str = "vllm") -> dict[str, str]:
        """The CPU engine's thread environment for an engine kind (see :func:`thread_env`)."""
        return thread_env(engine, self.omp_num_threads, self.custom_cpu_affinity)


SYSHAX_V0_ENGINE = "syshax-v0"  # sysHAX's patched vLLM V0 image: reads CUSTOM_CPU_AFFINITY


def thread_env(engine: str, omp_num_threads: int | str, cpu_list: str) -> dict[str, str]:
    """``OMP_NUM_THREADS`` and the CPUs the engine's OpenMP threads bind to, named the way the
    engine kind reads them.

    Upstream vLLM (V1) and ``syshax sim`` read ``VLLM_CPU_OMP_THREADS_BIND``: one CPU list per
    tensor-parallel rank, ranks joined by ``|``. The CPU engine is a single rank, so its list
    is the plan's CPUs as they are (``0-39,40-79`` spans two NUMA nodes in one rank); upstream
    starts one thread per listed CPU. Only sysHAX's patched V0 image reads
    ``CUSTOM_CPU_AFFINITY``; upstream never does. Empty values are left out.
    """
    name = "CUSTOM_CPU_AFFINITY" if engine == SYSHAX_V0_ENGINE else "VLLM_CPU_OMP_THREADS_BIND"
    env = {"OMP_NUM_THREADS": str(omp_num_threads), name: cpu_list}
    return {key: value for key, value in env.items() if value}


MAX_CPU_ID = 131071  # the largest CPU id accepted anywhere; checked before a range is expanded


def parse_cpu_list(text: str, *, field_name: str = "cpu_affinity") -> tuple[int, ...]:
    """Parse the kernel's list format (``"0-3,8,10-11"``) into sorted unique CPU ids.

    Ids above ``MAX_CPU_ID`` are refused before anything is expanded, so no input can make the
    parser build a huge set."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if hi < lo or lo < 0:
                    raise ValueError
            else:
                lo = hi = int(part)
                if lo < 0:
                    raise ValueError
        except ValueError:
            raise AffinityError(field_name, f"{part!r} is not a CPU number or range") from None
        if hi > MAX_CPU_ID:
            raise AffinityError(field_name, f"CPU {hi} is above the largest id, {MAX_CPU_ID}")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise AffinityError(field_name, "is empty")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpu_list`: ``[0,1,2,5]`` -> ``"0-2,5"``."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


def spread_evenly(wanted: int, capacity: Sequence[int]) -> list[int]:
    """Split ``wanted`` over bins of the given capacities as evenly as they allow.

    Water-filling: every bin gets the same share, a bin too small for it is filled and the rest
    is shared among the others; remainders go to the lowest-indexed bins with room.
    """
    counts = [0] * len(capacity)
    left = wanted
    open_bins = [i for i, cap in enumerate(capacity) if cap > 0]
    while left > 0 and open_bins:
        share = max(1, left // len(open_bins))
        for i in list(open_bins):
            take = min(share, capacity[i] - counts[i], left)
            counts[i] += take
            left -= take
            if counts[i] >= capacity[i]:
                open_bins.remove(i)
            if left == 0:
                break
    return counts


def plan_affinity(topology: Topology, request: AffinityRequest) -> AffinityPlan:
    """Place the CPU engine on ``topology``; raise :class:`AffinityError` naming the field."""
    if not topology.numa_nodes or topology.physical_cores == 0:
        raise AffinityError("topology", "the node reports no CPU cores")
    if not MIN_THREAD_RATIO <= request.thread_ratio <= MAX_THREAD_RATIO:
        raise AffinityError(
            "thread_ratio",
            f"must be between {MIN_THREAD_RATIO} and {MAX_THREAD_RATIO} threads per physical "
            f"core, got {request.thread_ratio}",
        )
    nodes = {node.index: node for node in topology.numa_nodes}
    gpu_host = _reserve_gpu_host(nodes, request)
    reserved = {cpu for core in gpu_host for cpu in core.cpus}

    if request.cpu_affinity is not None:
        return _explicit_plan(topology, request, gpu_host, reserved)

    allowed = _allowed_nodes(nodes, request)
    free = {i: [c for c in nodes[i].cores if not reserved & set(c.cpus)] for i in allowed}
    available = sum(len(cores) for cores in free.values())
    wanted = available if request.cpu_cores is None else request.cpu_cores
    if wanted < 1:
        raise AffinityError("cpu_cores", f"must be at least 1, got {wanted}")
    if wanted > available:
        raise AffinityError(
            "cpu_cores",
            f"asks for {wanted} physical cores but at most {available} are available "
            f"({topology.physical_cores} on the node, {len(gpu_host)} reserved for the GPU "
            f"engine's host threads)",
        )
    counts = spread_evenly(wanted, [len(free[i]) for i in allowed])
    chosen = {i: free[i][:n] for i, n in zip(allowed, counts, strict=True) if n}
    return _plan_from_cores(request, chosen, gpu_host)


def _allowed_nodes(nodes: dict[int, NumaNode], request: AffinityRequest) -> list[int]:
    if request.numa_nodes is None:
        return sorted(nodes)
    unknown = sorted(set(request.numa_nodes) - set(nodes))
    if unknown:
        raise AffinityError(
            "numa_nodes",
            f"node(s) {unknown} do not exist; this node has NUMA nodes {sorted(nodes)}",
        )
    return sorted(set(request.numa_nodes))


def _reserve_gpu_host(nodes: dict[int, NumaNode], request: AffinityRequest) -> list[Core]:
    if request.gpu_host_cores < 0:
        raise AffinityError("gpu_host_cores", f"must be 0 or more, got {request.gpu_host_cores}")
    if request.gpu_host_cores == 0:
        return []
    if request.gpu_numa_node not in nodes:
        raise AffinityError(
            "gpu_numa_node",
            f"NUMA node {request.gpu_numa_node} does not exist; this node has {sorted(nodes)}",
        )
    # The GPU's own node first (host threads near the PCIe root), then the others in order.
    order = [request.gpu_numa_node] + [i for i in sorted(nodes) if i != request.gpu_numa_node]
    pool = [core for i in order for core in nodes[i].cores]
    if request.gpu_host_cores >= len(pool):
        raise AffinityError(
            "gpu_host_cores",
            f"reserves {request.gpu_host_cores} cores but the node has only {len(pool)}; "
            "leave at least one for the CPU engine",
        )
    return pool[: request.gpu_host_cores]


def _explicit_plan(
    topology: Topology, request: AffinityRequest, gpu_host: list[Core], reserved: set[int]
) -> AffinityPlan:
    assert request.cpu_affinity is not None
    cpus = parse_cpu_list(request.cpu_affinity)
    known = set(topology.cpus)
    unknown = [c for c in cpus if c not in known]
    if unknown:
        raise AffinityError(
            "cpu_affinity",
            f"CPU(s) {format_cpu_list(unknown)} do not exist; this node has CPUs "
            f"{format_cpu_list(known)}",
        )
    clash = sorted(reserved & set(cpus))
    if clash:
        raise AffinityError(
            "cpu_affinity",
            f"CPU(s) {format_cpu_list(clash)} are reserved for the GPU engine's host threads; "
            f"use CPUs from {format_cpu_list(known - reserved)}",
        )
    wanted = set(cpus)
    chosen: dict[int, list[Core]] = {}
    partial: dict[int, list[int]] = {}
    for node in topology.numa_nodes:
        for core in node.cores:
            mine = [c for c in core.cpus if c in wanted]
            if mine:
                chosen.setdefault(node.index, []).append(Core(tuple(mine)))
                partial.setdefault(node.index, []).extend(mine)
    if request.cpu_cores is not None and request.cpu_cores != sum(map(len, chosen.values())):
        raise AffinityError(
            "cpu_cores",
            f"is {request.cpu_cores} but cpu_affinity {request.cpu_affinity!r} covers "
            f"{sum(map(len, chosen.values()))} physical cores",
        )
    plan = _plan_from_cores(request, chosen, gpu_host)
    # An explicit list is taken as written (siblings included), only grouped per NUMA node.
    return replace(
        plan,
        cpus=cpus,
        custom_cpu_affinity=",".join(format_cpu_list(partial[i]) for i in sorted(partial)),
    )


def _plan_from_cores(
    request: AffinityRequest, chosen: dict[int, list[Core]], gpu_host: list[Core]
) -> AffinityPlan:
    cores = sum(len(c) for c in chosen.values())
    threads = max(cores, math.floor(cores * request.thread_ratio + 1e-9))
    # Threads beyond one per core run on SMT siblings when the cores have them: add siblings
    # node by node, evenly, so the extra threads stay on their node's memory too.
    extra = threads - cores
    sibling_slots = [[cpu for core in chosen[i] for cpu in core.cpus[1:]] for i in sorted(chosen)]
    sibling_counts = spread_evenly(extra, [len(s) for s in sibling_slots])
    groups: list[list[int]] = []
    for (i, slots), n in zip(
        zip(sorted(chosen), sibling_slots, strict=True), sibling_counts, strict=True
    ):
        firsts = [core.cpus[0] for core in chosen[i]]
        groups.append(sorted(firsts + slots[:n]))
    cpus = tuple(sorted(c for g in groups for c in g))
    return AffinityPlan(
        cpus=cpus,
        physical_cores=cores,
        omp_num_threads=threads,
        custom_cpu_affinity=",".join(format_cpu_list(g) for g in groups),
        gpu_host_cpus=tuple(sorted(c for core in gpu_host for c in core.cpus)),
        cores_per_numa_node={i: len(chosen[i]) for i in sorted(chosen)},
    )
