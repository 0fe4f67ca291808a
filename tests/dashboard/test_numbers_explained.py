"""The node page's memory figures say what they count: a simulated card's memory (its
engine's weights plus the KV blocks in use, where vLLM shows its whole reserved pool), and a
NUMA split that does not add up to the node's memory (memory on NUMA nodes without CPUs)."""

from __future__ import annotations

from typing import Any

from django.test import Client

from controlplane.inventory.models import Accelerator, CpuTopology, NumaNode
from testbed.factories import GIB, build_node


def page(client: Client, name: str) -> str:
    response = client.get(f"/nodes/{name}/")
    assert response.status_code == 200
    return response.content.decode()


def test_a_simulated_cards_memory_is_explained_and_a_real_ones_is_not(admin_client: Any) -> None:
    node = build_node("sim-node", accelerators=1)
    html = page(admin_client, node.name)
    assert 'data-field="sim-memory"' in html
    assert "weights plus the KV-cache blocks in use" in html
    assert "gpu_memory_utilization" in html

    Accelerator.objects.filter(node=node).update(simulated=False)
    assert 'data-field="sim-memory"' not in page(admin_client, node.name)


def test_numa_memory_that_does_not_add_up_is_explained(admin_client: Any) -> None:
    node = build_node("vm", numa=1)  # one NUMA node of 32 GB, the node's total 32 GB
    assert 'data-field="numa-memory"' not in page(admin_client, node.name)

    # The VM's kernel puts 13.3 of its 23.5 GB on the NUMA node with the CPUs.
    CpuTopology.objects.filter(node=node).update(memory_total_bytes=int(23.5 * GIB))
    NumaNode.objects.filter(node=node).update(memory_total_bytes=int(13.3 * GIB))
    html = page(admin_client, node.name)
    assert 'data-field="numa-memory"' in html
    assert "The NUMA nodes with CPUs hold 13.3 of the node's 23.5 GB" in html
    assert "the other 10.2 GB sits on NUMA nodes without CPUs" in html
