"""The routers' Prometheus families (registered in apps.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.routers.models import RouterInstance


class RoutersCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        rate = GaugeMetricFamily(
            "syshax_router_request_rate", "Requests/s each router reported.", labels=["router"]
        )
        up = GaugeMetricFamily(
            "syshax_router_up", "1 when the router reported within its grace.", labels=["router"]
        )
        for router in RouterInstance.objects.all():
            rate.add_metric([router.name], router.request_rate)
            up.add_metric([router.name], int(router.is_alive))
        yield rate
        yield up
