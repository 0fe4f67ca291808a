"""The NUMA-aware affinity planner on the documents' Kunpeng, a 2-socket x86 and this machine."""

from __future__ import annotations

import os

import pytest

from agents.discovery import read_topology
from common.affinity import (
    AffinityError,
    AffinityRequest,
    Topology,
    format_cpu_list,
    parse_cpu_list,
    plan_affinity,
    spread_evenly,
    topology_from_inventory,
)

KUNPENG = Topology.uniform(numa_nodes=4, cores_per_node=40)  # Kunpeng 920 7280Z
XEON = Topology.uniform(numa_nodes=2, cores_per_node=56, threads_per_core=2)  # 2x56c SMT2


def test_kunpeng_whole_machine_matches_the_documents_cpu_mode() -> None:
    plan = plan_affinity(KUNPENG, AffinityRequest())
    assert plan.cpuset == "0-159"
    assert plan.omp_num_threads == 160
    assert plan.custom_cpu_affinity == "0-39,40-79,80-119,120-159"
    assert plan.cores_per_numa_node == {0: 40, 1: 40, 2: 40, 3: 40}


def test_kunpeng_hetero_reserves_gpu_host_cores_and_spreads_the_rest_evenly() -> None:
    plan = plan_affinity(KUNPENG, AffinityRequest(cpu_cores=96, gpu_host_cores=4))
    assert plan.gpu_host_cpuset == "0-3"
    assert plan.cores_per_numa_node == {0: 24, 1: 24, 2: 24, 3: 24}
    assert not set(plan.cpus) & set(plan.gpu_host_cpus)
    assert plan.custom_cpu_affinity == "4-27,40-63,80-103,120-143"
    # Upstream vLLM and the simulator read VLLM_CPU_OMP_THREADS_BIND (one rank: one list);
    # only sysHAX's patched V0 image reads CUSTOM_CPU_AFFINITY.
    binding = "4-27,40-63,80-103,120-143"
    for engine in ("vllm", "simulator"):
        assert plan.env(engine) == {"OMP_NUM_THREADS": "96", "VLLM_CPU_OMP_THREADS_BIND": binding}
    assert plan.env() == plan.env("vllm")
    assert plan.env("syshax-v0") == {"OMP_NUM_THREADS": "96", "CUSTOM_CPU_AFFINITY": binding}


def test_kunpeng_all_free_cores_when_node0_is_short_fills_the_others() -> None:
    plan = plan_affinity(KUNPENG, AffinityRequest(gpu_host_cores=4))
    assert plan.physical_cores == 156
    assert plan.cores_per_numa_node == {0: 36, 1: 40, 2: 40, 3: 40}


def test_thread_ratio_without_smt_oversubscribes_the_same_cpus() -> None:
    plan = plan_affinity(KUNPENG, AffinityRequest(cpu_cores=40, thread_ratio=1.5))
    assert plan.omp_num_threads == 60
    assert len(plan.cpus) == 40
    assert plan.cores_per_numa_node == {0: 10, 1: 10, 2: 10, 3: 10}


def test_xeon_smt_siblings_carry_the_extra_threads_on_their_own_node() -> None:
    plan = plan_affinity(XEON, AffinityRequest(cpu_cores=32, thread_ratio=1.5, gpu_host_cores=2))
    assert plan.gpu_host_cpuset == "0-1,112-113"  # whole cores, both hardware threads
    assert plan.physical_cores == 32 and plan.omp_num_threads == 48
    assert plan.cores_per_numa_node == {0: 16, 1: 16}
    # 16 extra threads -> 8 SMT siblings per node, siblings of the chosen cores only
    assert plan.custom_cpu_affinity == "2-17,114-121,56-71,168-175"
    assert plan.cpuset == "2-17,56-71,114-121,168-175"


def test_xeon_default_uses_one_thread_per_core_and_leaves_siblings_idle() -> None:
    plan = plan_affinity(XEON, AffinityRequest())
    assert plan.omp_num_threads == 112
    assert plan.cpuset == "0-111"


@pytest.mark.parametrize(
    ("request_", "field", "fragment"),
    [
        (AffinityRequest(cpu_cores=200), "cpu_cores", "at most 160"),
        (AffinityRequest(cpu_cores=157, gpu_host_cores=4), "cpu_cores", "at most 156"),
        (AffinityRequest(thread_ratio=2.0), "thread_ratio", "between 1.0 and 1.5"),
        (AffinityRequest(thread_ratio=0.5), "thread_ratio", "between 1.0 and 1.5"),
        (AffinityRequest(numa_nodes=(0, 7)), "numa_nodes", "[7] do not exist"),
        (AffinityRequest(cpu_affinity="150-170"), "cpu_affinity", "160-170 do not exist"),
        (AffinityRequest(cpu_affinity="0-9", gpu_host_cores=2), "cpu_affinity", "0-1 are reserved"),
        (AffinityRequest(cpu_affinity="x-3"), "cpu_affinity", "'x-3' is not a CPU"),
        (AffinityRequest(gpu_host_cores=160), "gpu_host_cores", "only 160"),
        (AffinityRequest(gpu_host_cores=1, gpu_numa_node=9), "gpu_numa_node", "does not exist"),
    ],
)
def test_impossible_requests_name_the_field_and_the_limit(
    request_: AffinityRequest, field: str, fragment: str
) -> None:
    with pytest.raises(AffinityError) as caught:
        plan_affinity(KUNPENG, request_)
    assert caught.value.field == field
    assert fragment in str(caught.value)


def test_explicit_affinity_is_taken_as_written_and_grouped_per_node() -> None:
    plan = plan_affinity(XEON, AffinityRequest(cpu_affinity="60-63,0-3,112-115"))
    assert plan.cpuset == "0-3,60-63,112-115"
    assert plan.physical_cores == 8
    assert plan.custom_cpu_affinity == "0-3,112-115,60-63"


def test_numa_restriction_keeps_the_engine_on_the_chosen_nodes() -> None:
    plan = plan_affinity(KUNPENG, AffinityRequest(cpu_cores=30, numa_nodes=(2, 3)))
    assert plan.cores_per_numa_node == {2: 15, 3: 15}
    assert plan.cpuset == "80-94,120-134"


def test_spread_and_list_helpers() -> None:
    assert spread_evenly(10, [3, 40, 40]) == [3, 4, 3]
    assert spread_evenly(5, [0, 0]) == [0, 0]
    assert format_cpu_list([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10"
    assert parse_cpu_list("0-2, 5,9-10") == (0, 1, 2, 5, 9, 10)


def test_this_machine_topology_plans_within_its_real_cpus() -> None:
    topology = read_topology()
    assert topology.physical_cores >= 1
    assert set(topology.cpus) <= set(range(os.cpu_count() or 1))
    plan = plan_affinity(topology, AffinityRequest())
    assert plan.physical_cores == topology.physical_cores
    assert set(plan.cpus) <= os.sched_getaffinity(0) | set(topology.cpus)
    with pytest.raises(AffinityError, match="cpu_cores"):
        plan_affinity(topology, AffinityRequest(cpu_cores=topology.physical_cores + 1))


def test_the_control_plane_can_rebuild_the_topology_from_an_inventory() -> None:
    xeon_numa = [{"index": 0, "cpus": "0-55,112-167"}, {"index": 1, "cpus": "56-111,168-223"}]
    rebuilt = topology_from_inventory(xeon_numa, physical_cores=112, threads=224)
    assert rebuilt == XEON
    kunpeng_numa = [{"index": i, "cpus": f"{i * 40}-{i * 40 + 39}"} for i in range(4)]
    assert topology_from_inventory(kunpeng_numa, physical_cores=160, threads=160) == KUNPENG
