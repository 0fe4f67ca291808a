"""The control plane's own Prometheus metrics: fleet state, routers and benchmark regressions.

Computed from the database at scrape time (a handful of grouped queries), so every web
process answers the same and nothing is lost on a restart.
"""

from __future__ import annotations

from django.db.models import Count
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.views import APIView

from controlplane.access.permissions import ScopedPermission


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(lines: list[str], name: str, kind: str, help_: str) -> None:
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} {kind}")


def render() -> str:
    from controlplane.benchmarks.models import BenchmarkRun
    from controlplane.deployments.models import Deployment
    from controlplane.inventory.models import Node
    from controlplane.policy.models import SchedulingPolicy
    from controlplane.routers.models import RouterInstance

    lines: list[str] = []
    _family(lines, "syshax_nodes", "gauge", "Nodes by status.")
    for status, count in (
        Node.objects.values_list("status").annotate(n=Count("pk")).order_by("status")
    ):
        lines.append(f'syshax_nodes{{status="{status}"}} {count}')
    _family(lines, "syshax_deployments", "gauge", "Deployments by observed state.")
    for state, count in (
        Deployment.objects.values_list("state").annotate(n=Count("pk")).order_by("state")
    ):
        lines.append(f'syshax_deployments{{state="{state}"}} {count}')
    _family(lines, "syshax_policy_version", "gauge", "Current version of each policy.")
    for name, version in SchedulingPolicy.objects.values_list("name", "version"):
        lines.append(f'syshax_policy_version{{policy="{_escape(name)}"}} {version}')
    _family(lines, "syshax_router_request_rate", "gauge", "Requests/s each router reported.")
    _family(lines, "syshax_router_up", "gauge", "1 when the router reported within its grace.")
    for router in RouterInstance.objects.all():
        label = f'router="{_escape(router.name)}"'
        lines.append(f"syshax_router_request_rate{{{label}}} {router.request_rate}")
        lines.append(f"syshax_router_up{{{label}}} {int(router.is_alive)}")
    _family(
        lines,
        "syshax_benchmark_regression",
        "gauge",
        "1 when the newest finished run of a deployment and scenario regressed.",
    )
    seen: set[tuple[int, int]] = set()
    finished = (
        BenchmarkRun.objects.filter(deployment__isnull=False, finished_at__isnull=False)
        .select_related("deployment", "scenario")
        .order_by("-finished_at")
    )
    for run in finished[:500]:
        key = (run.deployment_id or 0, run.scenario_id)
        if key in seen:
            continue
        seen.add(key)
        assert run.deployment is not None
        lines.append(
            f'syshax_benchmark_regression{{deployment="{_escape(run.deployment.name)}",'
            f'scenario="{_escape(run.scenario.name)}"}} {int(run.regression)}'
        )
    _family(lines, "syshax_benchmark_regressions_total", "counter", "Runs flagged as regressions.")
    lines.append(
        f"syshax_benchmark_regressions_total {BenchmarkRun.objects.filter(regression=True).count()}"
    )
    return "\n".join(lines) + "\n"


class MetricsView(APIView):
    permission_classes = [ScopedPermission]

    @extend_schema(responses={(200, "text/plain"): OpenApiTypes.STR})
    def get(self, request: Request) -> HttpResponse:
        return HttpResponse(render(), content_type="text/plain; version=0.0.4; charset=utf-8")
