"""The deployments' Prometheus families (registered in apps.py)."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.deployments.models import Deployment


class DeploymentsCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "syshax_deployments", "Deployments by observed state.", labels=["state"]
        )
        for state, count in (
            Deployment.objects.values_list("state").annotate(n=Count("pk")).order_by("state")
        ):
            family.add_metric([state], count)
        yield family
