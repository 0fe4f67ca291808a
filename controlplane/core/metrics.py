"""The control plane's own Prometheus metrics: one registry, one collector per app.

Each app registers a collector in its ``AppConfig.ready`` (``register``); the collectors
compute their families from the database at scrape time (a handful of grouped queries), so
every web process answers the same and nothing is lost on a restart. The exposition is
prometheus_client's. The view has the API's default permission (settings: staff and
operators read it, machines do not), so this module needs nothing from the access app.
"""

from __future__ import annotations

from collections.abc import Iterator

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from rest_framework.request import Request
from rest_framework.views import APIView

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_collectors: dict[str, Collector] = {}


def register(app_label: str, collector: Collector) -> None:
    """Add (or, on a second ``ready``, replace) ``app_label``'s collector."""
    _collectors[app_label] = collector


class _Apps(Collector):
    def collect(self) -> Iterator[Metric]:
        for label in sorted(_collectors):
            yield from _collectors[label].collect()


_registry = CollectorRegistry(auto_describe=False)
_registry.register(_Apps())


def render() -> bytes:
    return generate_latest(_registry)


class MetricsView(APIView):
    @extend_schema(responses={(200, "text/plain"): OpenApiTypes.STR})
    def get(self, request: Request) -> HttpResponse:
        return HttpResponse(render(), content_type=CONTENT_TYPE)
