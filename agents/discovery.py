"""Hardware discovery: the inventory and heartbeat payloads of docs/machine-api.md.

Real hardware is read from psutil, ``/proc/cpuinfo``, ``/sys/devices/system/{node,cpu}``, NVML
and ``npu-smi``; any of them may be missing and discovery then reports less, never fails.
Simulated accelerators come from the agent's configuration and are always marked simulated.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from agents import __version__
from common.affinity import Topology, format_cpu_list, parse_cpu_list
from common.inventory import inventory_hash
from common.reports import (
    CardReading,
    CardReport,
    CpuReport,
    HeartbeatReport,
    InventoryReport,
    NumaReport,
)

log = logging.getLogger("syshax.agent")

GIB = 1024**3

# The ISA features that matter for CPU inference kernels (SIMD width, int8/bf16 dot products,
# matrix engines). Everything else in /proc/cpuinfo is noise for placement.
_ISA_EXACT = {
    "asimd",
    "asimdhp",
    "asimddp",
    "sve",
    "sve2",
    "i8mm",
    "bf16",
    "svei8mm",
    "svebf16",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
}
_ISA_PREFIXES = ("avx512", "amx")


@dataclass(frozen=True)
class AcceleratorPreset:
    vendor: str
    model: str
    kind: str
    memory_bytes: int


# Presets for --simulate-accelerator. The first four are the simulator's device presets
# (common/presets.py), so `syshax sim --device <preset>` models the same card; t4-16gb and
# l40s-48gb exist for inventory and placement demos only (t4 is under the 20 GB per-card floor).
SIMULATED_PRESETS: dict[str, AcceleratorPreset] = {
    "a100-80gb": AcceleratorPreset("NVIDIA", "A100-SXM4-80GB", "gpu", 80 * GIB),
    "h100-80gb": AcceleratorPreset("NVIDIA", "H100-SXM5-80GB", "gpu", 80 * GIB),
    "ascend-910b": AcceleratorPreset("Huawei", "Ascend 910B", "npu", 64 * GIB),
    "a10-24gb": AcceleratorPreset("NVIDIA", "A10", "gpu", 24 * GIB),
    "l40s-48gb": AcceleratorPreset("NVIDIA", "L40S", "gpu", 48 * GIB),
    "t4-16gb": AcceleratorPreset("NVIDIA", "Tesla T4", "gpu", 16 * GIB),
}


def parse_simulated(specs: Iterable[str]) -> list[str]:
    """Expand ``["a100-80gb*2", "l40s-48gb"]`` into one preset name per card; reject unknowns."""
    out: list[str] = []
    for spec in specs:
        name, _, count = spec.partition("*")
        name = name.strip().lower()
        if name not in SIMULATED_PRESETS:
            known = ", ".join(sorted(SIMULATED_PRESETS))
            raise ValueError(f"--simulate-accelerator: unknown preset {name!r} (known: {known})")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"--simulate-accelerator: bad count in {spec!r}") from None
        if n < 1:
            raise ValueError(f"--simulate-accelerator: count must be >= 1 in {spec!r}")
        out += [name] * n
    return out


# ---------------------------------------------------------------- CPU and NUMA


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_topology(sys_root: str | Path = "/sys") -> Topology:
    """The node's NUMA nodes and physical cores, from sysfs (one node when NUMA is absent)."""
    root = Path(sys_root) / "devices/system"
    node_cpus: dict[int, list[int]] = {}
    for node_dir in sorted((root / "node").glob("node[0-9]*")):
        text = (_read(node_dir / "cpulist") or "").strip()
        if text:
            node_cpus[int(node_dir.name[4:])] = list(parse_cpu_list(text))
    online = (_read(root / "cpu/online") or "").strip()
    all_cpus = list(parse_cpu_list(online)) if online else list(range(os.cpu_count() or 1))
    if not node_cpus:
        node_cpus = {0: all_cpus}
    core_of: dict[int, int] = {}
    for cpu in all_cpus:
        topo = root / f"cpu/cpu{cpu}/topology"
        package = (_read(topo / "physical_package_id") or "").strip()
        core = (_read(topo / "core_id") or "").strip()
        if package and core:
            # One integer key per (package, core): core ids repeat across sockets.
            core_of[cpu] = int(package) * 1_000_000 + int(core)
    return Topology.from_cpu_map(node_cpus, core_of)


def _cpuinfo_fields(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, _, value = line.partition(":")
        current[key.strip().lower()] = value.strip()
    if current:
        blocks.append(current)
    return blocks


# ARM parts name themselves only by implementer/part numbers in /proc/cpuinfo.
_ARM_PARTS = {
    ("0x48", "0xd01"): "HiSilicon Kunpeng 920",
    ("0x48", "0xd02"): "HiSilicon Kunpeng 930",
    ("0x41", "0xd0c"): "ARM Neoverse N1",
    ("0x41", "0xd40"): "ARM Neoverse V1",
    ("0x41", "0xd4f"): "ARM Neoverse V2",
}


def cpu_model_and_flags(cpuinfo_text: str) -> tuple[str, list[str]]:
    blocks = _cpuinfo_fields(cpuinfo_text)
    first = next((b for b in blocks if "processor" in b), blocks[0] if blocks else {})
    model = first.get("model name") or first.get("cpu model") or ""
    if not model and "cpu part" in first:
        key = (first.get("cpu implementer", "").lower(), first["cpu part"].lower())
        model = _ARM_PARTS.get(key, f"ARM implementer {key[0]} part {key[1]}")
    raw = (first.get("flags") or first.get("features") or "").split()
    flags = sorted({f for f in raw if f in _ISA_EXACT or f.startswith(_ISA_PREFIXES)})
    return model or platform.processor() or "unknown", flags


def numa_nodes(sys_root: str | Path = "/sys", topology: Topology | None = None) -> list[NumaReport]:
    """``topology`` saves re-reading sysfs when the caller has it already."""
    topology = topology or read_topology(sys_root)
    nodes: list[NumaReport] = []
    for node in topology.numa_nodes:
        meminfo = _read(Path(sys_root) / f"devices/system/node/node{node.index}/meminfo") or ""
        match = re.search(r"MemTotal:\s+(\d+)\s*kB", meminfo)
        memory = int(match.group(1)) * 1024 if match else 0
        if not match and len(topology.numa_nodes) == 1:
            memory = psutil.virtual_memory().total
        nodes.append(
            {"index": node.index, "cpus": format_cpu_list(node.cpus), "memory_total_bytes": memory}
        )
    return nodes


def cpu_inventory(
    sys_root: str | Path = "/sys",
    proc_root: str | Path = "/proc",
    topology: Topology | None = None,
) -> CpuReport:
    model, flags = cpu_model_and_flags(_read(Path(proc_root) / "cpuinfo") or "")
    topology = topology or read_topology(sys_root)
    packages = set()
    for cpu in topology.cpus:
        pkg = _read(Path(sys_root) / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        if pkg is not None:
            packages.add(pkg.strip())
    return {
        "model": model,
        "architecture": platform.machine(),
        "sockets": max(1, len(packages)),
        "physical_cores": topology.physical_cores or psutil.cpu_count(logical=False) or 1,
        "threads": len(topology.cpus) or psutil.cpu_count() or 1,
        "isa_flags": flags,
        "memory_total_bytes": psutil.virtual_memory().total,
    }


# ---------------------------------------------------------------- accelerators


def nvidia_accelerators() -> list[CardReport]:
    """NVIDIA GPUs through NVML; an empty list when the driver or library is absent."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        out: list[CardReport] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            out.append(
                {
                    "kind": "gpu",
                    "vendor": "NVIDIA",
                    "model": name.decode() if isinstance(name, bytes) else str(name),
                    "index": i,
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "memory_total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    "simulated": False,
                }
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_npu_smi_list(text: str) -> list[CardReport]:
    """Parse ``npu-smi info -l`` (one block per NPU: ``NPU ID``, ``Product Name``, ...)."""
    out: list[CardReport] = []
    for block in re.split(r"\n\s*\n", text):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        if "npu id" not in fields:
            continue
        index = int(fields["npu id"])
        model = fields.get("product name") or fields.get("name") or "Ascend"
        memory = re.search(r"(\d+)\s*([MG]B)?", fields.get("memory size", ""), re.IGNORECASE)
        scale = GIB if memory and (memory.group(2) or "").upper() == "GB" else 1024**2
        out.append(
            {
                "kind": "npu",
                "vendor": "Huawei",
                "model": model,
                "index": index,
                "uuid": f"NPU-{fields.get('serial number') or index}",
                "memory_total_bytes": int(memory.group(1)) * scale if memory else 0,
                "simulated": False,
            }
        )
    return out


def ascend_accelerators(npu_smi: str = "npu-smi") -> list[CardReport]:
    path = shutil.which(npu_smi)
    if path is None:
        return []
    try:
        result = subprocess.run([path, "info", "-l"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_npu_smi_list(result.stdout) if result.returncode == 0 else []


def simulated_accelerators(presets: Sequence[str], node_name: str) -> list[CardReport]:
    out: list[CardReport] = []
    for index, name in enumerate(presets):
        preset = SIMULATED_PRESETS[name]
        # Stable per node and slot, so the inventory hash does not change between restarts.
        ident = uuid.uuid5(uuid.NAMESPACE_DNS, f"{node_name}.{index}.{name}.syshax-sim")
        out.append(
            {
                "kind": preset.kind,
                "vendor": preset.vendor,
                "model": preset.model,
                "index": index,
                "uuid": f"SIM-{ident}",
                "memory_total_bytes": preset.memory_bytes,
                "simulated": True,
                "preset": name,
            }
        )
    return out


# ---------------------------------------------------------------- payloads


def primary_address(towards: str | None = None) -> str:
    """The address other machines reach us on: the source address of a route to ``towards``."""
    host = towards or "8.8.8.8"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def collect_inventory(
    *,
    node_name: str,
    simulated: Sequence[str] = (),
    address: str | None = None,
    sys_root: str | Path = "/sys",
    proc_root: str | Path = "/proc",
    npu_smi: str = "npu-smi",
) -> InventoryReport:
    accelerators = nvidia_accelerators() + ascend_accelerators(npu_smi)
    sims = simulated_accelerators(simulated, node_name)
    for offset, acc in enumerate(sims):
        acc["index"] = len(accelerators) + offset
    topology = read_topology(sys_root)
    return {
        "agent_version": __version__,
        "hostname": socket.gethostname(),
        "address": address or primary_address(),
        "cpu": cpu_inventory(sys_root, proc_root, topology),
        "numa_nodes": numa_nodes(sys_root, topology),
        "accelerators": accelerators + sims,
    }


# collect_heartbeat's ``inventory_hash`` parameter shadows the function's name there.
_hash_inventory = inventory_hash


# ---------------------------------------------------------------- simulated live load

SIM_INFO_TIMEOUT_S = 0.5  # per engine: a heartbeat must not wait on a stuck engine
SIM_INFO_BUDGET_S = 1.5  # all engines of one beat together; the rest count as idle
IDLE_MEMORY_FRACTION = 0.01  # what a card with no engine shows: driver and context only
IDLE_TEMPERATURE_C = 32.0
TEMPERATURE_C_PER_PERCENT = 0.45  # 100 % busy settles at 77 degC, as a datacentre card does


@dataclass(frozen=True)
class DeviceReading:
    """One ``/sim/info`` ``device_usage`` reading; both times are simulated seconds."""

    busy_seconds: float
    uptime_seconds: float
    memory_used_bytes: int


@dataclass(frozen=True)
class CardLoad:
    utilization_percent: float
    memory_used_bytes: int


def utilisation_percent(previous: DeviceReading | None, current: DeviceReading) -> float:
    """Busy time over elapsed simulated time since ``previous``, in percent (0-100).

    Without a usable previous reading (the first beat, or the engine restarted and its clock
    went back) the window is the engine's whole life so far.
    """
    if previous is None or current.uptime_seconds <= previous.uptime_seconds:
        previous = DeviceReading(0.0, 0.0, 0)
    elapsed = current.uptime_seconds - previous.uptime_seconds
    if elapsed <= 0:
        return 0.0
    busy = current.busy_seconds - previous.busy_seconds
    return min(100.0, max(0.0, 100.0 * busy / elapsed))


def modelled_temperature_c(utilization_percent: float) -> float:
    """A modelled die temperature: linear in utilisation, no thermal lag. Never measured."""
    return round(IDLE_TEMPERATURE_C + TEMPERATURE_C_PER_PERCENT * utilization_percent, 1)


def simulated_load(acc: Mapping[str, Any], load: CardLoad | None) -> CardReading:
    """The heartbeat figures of a simulated card: its engines' load, or idle without one."""
    if load is None:
        load = CardLoad(0.0, int(int(acc["memory_total_bytes"]) * IDLE_MEMORY_FRACTION))
    util = round(min(100.0, max(0.0, load.utilization_percent)), 1)
    return {
        "uuid": acc["uuid"],
        "utilization_percent": util,
        "memory_used_bytes": min(int(acc["memory_total_bytes"]), load.memory_used_bytes),
        "temperature_c": modelled_temperature_c(util),
        "simulated": True,
    }


def combine_card_loads(
    engines: Iterable[tuple[Sequence[str], float, int]],
) -> dict[str, CardLoad]:
    """Per card, from (cards, utilisation, memory) per engine.

    A tensor-parallel engine keeps every card of its group equally busy and splits its memory
    evenly; two engines on one card add up (utilisation capped at 100 %).
    """
    out: dict[str, CardLoad] = {}
    for cards, util, memory in engines:
        if not cards:
            continue
        share = memory // len(cards)
        for card in cards:
            prev = out.get(card, CardLoad(0.0, 0))
            out[card] = CardLoad(
                min(100.0, prev.utilization_percent + util), prev.memory_used_bytes + share
            )
    return out


@dataclass(frozen=True)
class EngineOnCards:
    """A running GPU-role engine the agent started, and the cards its spec gave it."""

    engine_id: str
    endpoint: str | None
    cards: tuple[str, ...]


class SimulatedLoadReader:
    """Reads each simulated engine's ``/sim/info`` once per beat, keeping the previous reading
    per engine so utilisation is measured over the interval between beats.

    Used only from the heartbeat thread. Any failure - no endpoint, no answer in time, not a
    simulator - leaves that engine's cards idle and is logged at debug level; it never fails
    or delays the heartbeat beyond ``SIM_INFO_BUDGET_S``.
    """

    def __init__(
        self, timeout: float = SIM_INFO_TIMEOUT_S, budget: float = SIM_INFO_BUDGET_S
    ) -> None:
        self.timeout = timeout
        self.budget = budget
        self._previous: dict[str, DeviceReading] = {}
        self._not_simulators: set[str] = set()
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def read(self, engines: Iterable[EngineOnCards]) -> dict[str, CardLoad]:
        deadline = time.monotonic() + self.budget
        found: list[tuple[Sequence[str], float, int]] = []
        seen: set[str] = set()
        for engine in engines:
            seen.add(engine.engine_id)
            if time.monotonic() >= deadline:
                log.debug("engine %s: no time left in this beat; cards idle", engine.engine_id)
                continue
            reading = self._fetch(engine)
            if reading is None:
                continue
            util = utilisation_percent(self._previous.get(engine.engine_id), reading)
            self._previous[engine.engine_id] = reading
            found.append((engine.cards, util, reading.memory_used_bytes))
        for gone in set(self._previous) - seen:
            del self._previous[gone]
        return combine_card_loads(found)

    def _fetch(self, engine: EngineOnCards) -> DeviceReading | None:
        if engine.endpoint is None:
            log.debug("engine %s has no endpoint; its cards report idle", engine.engine_id)
            return None
        try:
            r = self._http.get(engine.endpoint + "/sim/info")
        except httpx.HTTPError as exc:
            log.debug("engine %s: /sim/info %s; cards idle", engine.engine_id, type(exc).__name__)
            return None
        reading = _device_reading(r) if r.status_code == 200 else None
        if reading is None and engine.engine_id not in self._not_simulators:
            self._not_simulators.add(engine.engine_id)  # said once, not every beat
            log.debug(
                "engine %s is not a syshax simulator (/sim/info: HTTP %d); "
                "its simulated cards report idle",
                engine.engine_id,
                r.status_code,
            )
        return reading


def _device_reading(response: httpx.Response) -> DeviceReading | None:
    """The ``device_usage`` of a /sim/info answer, or None if it has none (not a simulator,
    or one older than the figure)."""
    try:
        usage = response.json()["device_usage"]
        return DeviceReading(
            float(usage["busy_seconds_total"]),
            float(usage["uptime_seconds"]),
            int(usage["memory_used_bytes"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


def nvidia_load() -> dict[str, CardReading]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        out: dict[str, CardReading] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uid = _text(pynvml.nvmlDeviceGetUUID(h))
            out[uid] = {
                "uuid": uid,
                "utilization_percent": float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
                "memory_used_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).used),
                "temperature_c": float(
                    pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
                ),
                "simulated": False,
            }
        return out
    finally:
        pynvml.nvmlShutdown()


def collect_heartbeat(
    inventory: Mapping[str, Any],
    *,
    simulated_loads: Mapping[str, CardLoad] | None = None,
    inventory_hash: str | None = None,
) -> HeartbeatReport:
    """The heartbeat; ``simulated_loads`` (from ``SimulatedLoadReader``) holds the simulated
    cards that have an engine, and every other simulated card reports idle.

    ``inventory_hash``, when the caller knows it, saves hashing the inventory every beat.
    """
    memory = psutil.virtual_memory()
    sim_loads = simulated_loads or {}
    # NVML is initialised and shut down per call: only worth it when there is a real GPU.
    has_nvidia = any(
        acc.get("vendor") == "NVIDIA" and not acc.get("simulated")
        for acc in inventory.get("accelerators", [])
    )
    real = nvidia_load() if has_nvidia else {}
    accelerators: list[CardReading] = []
    for acc in inventory.get("accelerators", []):
        if acc.get("simulated"):
            accelerators.append(simulated_load(acc, sim_loads.get(acc["uuid"])))
        elif acc["uuid"] in real:
            accelerators.append(real[acc["uuid"]])
    return {
        "cpu_percent": float(psutil.cpu_percent(interval=None)),
        "memory_used_bytes": int(memory.total - memory.available),
        "memory_total_bytes": int(memory.total),
        "inventory_hash": _hash_inventory(inventory) if inventory_hash is None else inventory_hash,
        "accelerators": accelerators,
    }
