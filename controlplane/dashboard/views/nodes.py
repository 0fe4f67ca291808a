from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from controlplane.dashboard import charts, services
from controlplane.dashboard.views.overview import serving_context
from controlplane.inventory.models import Node

HEARTBEAT_HISTORY = 60


@login_required
def node_list(request: HttpRequest) -> HttpResponse:
    nodes = Node.objects.prefetch_related("accelerators").select_related("cpu")
    return render(request, "dashboard/node_list.html", {"nodes": nodes})


@login_required
def node_detail(request: HttpRequest, name: str) -> HttpResponse:
    node = get_object_or_404(Node.objects.select_related("cpu"), name=name)
    heartbeats = list(node.heartbeats.all()[:HEARTBEAT_HISTORY])
    oldest_first = list(reversed(heartbeats))
    topology = services.node_topology(node)
    accelerators = list(node.accelerators.all())
    total = getattr(getattr(node, "cpu", None), "memory_total_bytes", 0) or 0
    context = {
        "node": node,
        "alive": node.is_alive(),
        "topology": topology,
        "memory_unaccounted_gb": topology.memory_unaccounted_gb(total),
        "accelerators": accelerators,
        "simulated_cards": any(acc.simulated for acc in accelerators),
        "deployments": list(node.deployments.select_related("profile")),
        "heartbeats": heartbeats[:15],
        "heartbeat_count": len(heartbeats),
        "cpu_spark": charts.sparkline(
            [hb.cpu_percent for hb in oldest_first],
            title=f"CPU use of node {node.name} over its last {len(heartbeats)} heartbeats",
        ),
        **serving_context(request, node=node),
    }
    return render(request, "dashboard/node_detail.html", context)
