"""The policies' Prometheus families (registered in apps.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.policy.models import SchedulingPolicy


class PolicyCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "syshax_policy_version", "Current version of each policy.", labels=["policy"]
        )
        for name, version in SchedulingPolicy.objects.values_list("name", "version"):
            family.add_metric([name], version)
        yield family
