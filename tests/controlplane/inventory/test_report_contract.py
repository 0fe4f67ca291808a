"""The agent's reports and the control plane's validator name the same fields, and what the
agent builds passes it (common/reports.py)."""

from __future__ import annotations

import pytest

from agents.discovery import collect_heartbeat, collect_inventory
from common.reports import (
    AGENT_ONLY,
    CardReading,
    CardReport,
    CpuReport,
    HeartbeatReport,
    InventoryReport,
    NumaReport,
)
from controlplane.inventory.api.serializers import (
    AcceleratorReadingSerializer,
    HeartbeatInSerializer,
    InventorySerializer,
    ReportedAcceleratorSerializer,
    ReportedCpuSerializer,
    ReportedNumaSerializer,
)

PAIRS = [
    (CpuReport, ReportedCpuSerializer),
    (NumaReport, ReportedNumaSerializer),
    (CardReport, ReportedAcceleratorSerializer),
    (InventoryReport, InventorySerializer),
    (CardReading, AcceleratorReadingSerializer),
    (HeartbeatReport, HeartbeatInSerializer),
]


@pytest.mark.parametrize(("report", "serializer"), PAIRS, ids=lambda p: p.__name__)
def test_the_report_and_its_validator_name_the_same_fields(report, serializer) -> None:
    keys = set(report.__required_keys__) | set(report.__optional_keys__)
    assert set(serializer().fields) == keys - AGENT_ONLY.get(report, set())


def test_what_the_agent_builds_passes_the_validator() -> None:
    inventory = collect_inventory(node_name="contract", simulated=["a100-80gb", "a100-80gb"])
    checked = InventorySerializer(data=inventory)
    assert checked.is_valid(), checked.errors
    assert len(checked.validated_data["accelerators"]) >= 2
    beat = collect_heartbeat(inventory)
    checked = HeartbeatInSerializer(data=beat)
    assert checked.is_valid(), checked.errors
    assert {a["uuid"] for a in checked.validated_data["accelerators"]} >= {
        a["uuid"] for a in inventory["accelerators"] if a["simulated"]
    }
