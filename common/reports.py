"""What an agent reports about its node: the inventory and the heartbeat.

The agent builds these (``agents/discovery.py``) and the control plane validates them, with
its serializers (``controlplane/inventory/api/serializers.py``: the one validator, which
answers 400 naming the field and its limit). A contract test holds the two to the same
fields: every field here is one the serializers read, except the ``AGENT_ONLY`` ones, which
the agent keeps for itself and the control plane ignores.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class CpuReport(TypedDict):
    model: str
    architecture: str
    sockets: int
    physical_cores: int
    threads: int
    isa_flags: list[str]
    memory_total_bytes: int


class NumaReport(TypedDict):
    index: int
    cpus: str  # a CPU list ("0-39,80-119"; common.affinity)
    memory_total_bytes: int


class CardReport(TypedDict):
    kind: str  # "gpu" or "npu"
    vendor: str
    model: str
    index: int
    uuid: str
    memory_total_bytes: int
    simulated: bool
    preset: NotRequired[str]  # a simulated card's device preset (AGENT_ONLY)


class InventoryReport(TypedDict):
    agent_version: str
    hostname: str
    address: str
    cpu: CpuReport
    numa_nodes: list[NumaReport]
    accelerators: list[CardReport]


class CardReading(TypedDict):
    uuid: str
    utilization_percent: float
    memory_used_bytes: int
    temperature_c: float | None
    simulated: bool  # AGENT_ONLY


class HeartbeatReport(TypedDict):
    cpu_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    inventory_hash: str
    accelerators: list[CardReading]


# Fields the agent keeps in its own copy of a report; the control plane reads none of them.
AGENT_ONLY = {CardReport: {"preset"}, CardReading: {"simulated"}}
