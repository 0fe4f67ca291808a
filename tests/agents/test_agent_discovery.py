"""Discovery on this machine, on a Kunpeng-shaped sysfs tree, and simulated accelerators."""

from __future__ import annotations

import os
import platform
import stat
from pathlib import Path

import psutil
import pytest

from agents.discovery import (
    CardLoad,
    ascend_accelerators,
    collect_heartbeat,
    collect_inventory,
    cpu_model_and_flags,
    parse_simulated,
    read_topology,
)
from common.affinity import AffinityRequest, plan_affinity
from common.inventory import inventory_hash

KUNPENG_CPUINFO = "".join(
    f"processor\t: {i}\nBogoMIPS\t: 200.00\n"
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
    "jscvt fcma dcpop asimddp asimdfhm sve i8mm bf16\n"
    "CPU implementer\t: 0x48\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd01\n\n"
    for i in range(2)
)


def write_kunpeng_sysfs(root: Path) -> Path:
    """A sysfs tree shaped like the Kunpeng 920 7280Z: 2 sockets, 4 NUMA nodes of 40 cores."""
    system = root / "devices/system"
    (system / "cpu").mkdir(parents=True)
    (system / "cpu/online").write_text("0-159\n")
    for node in range(4):
        d = system / f"node/node{node}"
        d.mkdir(parents=True)
        d.joinpath("cpulist").write_text(f"{node * 40}-{node * 40 + 39}\n")
        d.joinpath("meminfo").write_text(f"Node {node} MemTotal:  134217728 kB\n")
    for cpu in range(160):
        t = system / f"cpu/cpu{cpu}/topology"
        t.mkdir(parents=True)
        t.joinpath("physical_package_id").write_text(f"{cpu // 80}\n")
        t.joinpath("core_id").write_text(f"{cpu % 80}\n")
    return root


def test_this_machine_inventory_is_real_and_its_hash_is_stable() -> None:
    inventory = collect_inventory(node_name="t1")
    cpu = inventory["cpu"]
    assert cpu["architecture"] == platform.machine()
    assert cpu["threads"] == len(os.sched_getaffinity(0)) or cpu["threads"] == os.cpu_count()
    assert cpu["physical_cores"] == psutil.cpu_count(logical=False)
    assert cpu["memory_total_bytes"] == psutil.virtual_memory().total
    raw = Path("/proc/cpuinfo").read_text()
    assert set(cpu["isa_flags"]) <= set(raw.split())
    assert inventory["numa_nodes"] and inventory["numa_nodes"][0]["memory_total_bytes"] > 0
    assert inventory["accelerators"] == []  # no GPU, no NPU on the test machine
    assert inventory_hash(inventory) == inventory_hash(collect_inventory(node_name="t1"))
    assert len(inventory_hash(inventory)) == 64  # hex, as the control plane stores it


def test_kunpeng_sysfs_and_cpuinfo_give_the_documents_topology(tmp_path: Path) -> None:
    root = write_kunpeng_sysfs(tmp_path / "sys")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(KUNPENG_CPUINFO)
    inventory = collect_inventory(node_name="kp", sys_root=root, proc_root=tmp_path / "proc")
    cpu = inventory["cpu"]
    assert cpu["model"] == "HiSilicon Kunpeng 920"
    assert cpu["sockets"] == 2 and cpu["physical_cores"] == 160 and cpu["threads"] == 160
    assert cpu["isa_flags"] == ["asimd", "asimddp", "asimdhp", "bf16", "i8mm", "sve"]
    assert [n["cpus"] for n in inventory["numa_nodes"]] == ["0-39", "40-79", "80-119", "120-159"]
    assert inventory["numa_nodes"][2]["memory_total_bytes"] == 128 * 1024**3
    plan = plan_affinity(read_topology(root), AffinityRequest())
    assert plan.omp_num_threads == 160


def test_x86_flags_keep_the_vector_and_matrix_extensions() -> None:
    model, flags = cpu_model_and_flags(
        "processor : 0\nmodel name : Intel Xeon Platinum 8480+\n"
        "flags : fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_int8 ht\n"
    )
    assert model == "Intel Xeon Platinum 8480+"
    assert flags == ["amx_int8", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "fma"]


def test_simulated_accelerators_are_marked_stable_and_validated() -> None:
    assert parse_simulated(["a100-80gb*2", "L40S-48GB"]) == ["a100-80gb", "a100-80gb", "l40s-48gb"]
    with pytest.raises(ValueError, match="unknown preset 'b200'"):
        parse_simulated(["b200"])
    inv = collect_inventory(node_name="n1", simulated=["a100-80gb", "a100-80gb"])
    accs = inv["accelerators"]
    assert [a["simulated"] for a in accs] == [True, True]
    assert accs[0]["model"] == "A100-SXM4-80GB" and accs[0]["memory_total_bytes"] == 80 * 1024**3
    assert accs[0]["uuid"] != accs[1]["uuid"]
    again = collect_inventory(node_name="n1", simulated=["a100-80gb", "a100-80gb"])
    assert [a["uuid"] for a in again["accelerators"]] == [a["uuid"] for a in accs]
    other = collect_inventory(node_name="n2", simulated=["a100-80gb"])
    assert other["accelerators"][0]["uuid"] != accs[0]["uuid"]


def test_heartbeat_reports_live_load_and_labels_simulated_cards() -> None:
    inv = collect_inventory(node_name="n1", simulated=["a100-80gb", "a100-80gb"])
    busy_uuid = inv["accelerators"][0]["uuid"]
    loads = {busy_uuid: CardLoad(utilization_percent=62.5, memory_used_bytes=70 * 1024**3)}
    beat = collect_heartbeat(inv, simulated_loads=loads)
    assert 0.0 <= beat["cpu_percent"] <= 100.0
    assert 0 < beat["memory_used_bytes"] < beat["memory_total_bytes"]
    assert beat["inventory_hash"] == inventory_hash(inv)
    busy, idle = beat["accelerators"]
    assert busy["simulated"] and idle["simulated"]
    # The card with an engine carries the engine's figures; the other one is idle.
    assert (busy["utilization_percent"], busy["memory_used_bytes"]) == (62.5, 70 * 1024**3)
    assert idle["utilization_percent"] == 0.0
    assert 0 < idle["memory_used_bytes"] < 1024**3  # a small baseline
    assert 30 < idle["temperature_c"] < busy["temperature_c"] < 95


@pytest.mark.process
def test_ascend_npus_are_read_from_npu_smi(tmp_path: Path) -> None:
    # MOCK: Ascend hardware cannot exist here; a stand-in npu-smi prints the real tool's layout.
    tool = tmp_path / "npu-smi"
    tool.write_text(
        "#!/bin/sh\ncat <<'EOF'\n"
        "        Total Count                    : 2\n\n"
        "        NPU ID                         : 0\n        Product Name                   : "
        "Ascend 910B\n        Serial Number                  : 033VNY10M4000123\n"
        "        Memory Size                    : 65536 MB\n\n"
        "        NPU ID                         : 1\n        Product Name                   : "
        "Ascend 910B\n        Serial Number                  : 033VNY10M4000124\n"
        "EOF\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    npus = ascend_accelerators(str(tool))
    assert [n["index"] for n in npus] == [0, 1]
    assert npus[0]["kind"] == "npu" and npus[0]["model"] == "Ascend 910B"
    assert npus[0]["uuid"] == "NPU-033VNY10M4000123" and not npus[0]["simulated"]
    assert npus[0]["memory_total_bytes"] == 64 * 1024**3
    assert ascend_accelerators(str(tmp_path / "absent")) == []
