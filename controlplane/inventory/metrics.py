"""The inventory's Prometheus families (registered in apps.py)."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.inventory.models import Node


class InventoryCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        nodes = GaugeMetricFamily("syshax_nodes", "Nodes by status.", labels=["status"])
        for status, count in (
            Node.objects.values_list("status").annotate(n=Count("pk")).order_by("status")
        ):
            nodes.add_metric([status], count)
        yield nodes
