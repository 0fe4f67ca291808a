from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.template.loader import render_to_string
from django.utils.http import urlencode

from controlplane.dashboard import live, services
from controlplane.deployments.models import Deployment
from controlplane.inventory.models import Node


def serving_context(
    request: HttpRequest, *, deployment: Deployment | None = None, node: Node | None = None
) -> dict[str, Any]:
    """The live serving panel's context for the fleet, one deployment or one node."""
    if deployment is not None:
        ids: list[int] | None = [deployment.pk]
        scope, query = f"deployment {deployment.name}", {"deployment": str(deployment.pk)}
    elif node is not None:
        ids = list(node.deployments.values_list("pk", flat=True))
        scope, query = f"node {node.name}", {"node": node.name}
    else:
        ids, scope, query = None, "fleet", {}
    return {
        "serving": live.serving_panel(request.GET.get("window"), deployments=ids, scope=scope),
        "serving_windows": list(live.WINDOWS.values()),
        "serving_query": urlencode(query),
    }


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(
        request, "dashboard/overview.html", {**services.overview(), **serving_context(request)}
    )


@login_required
def accelerators_json(request: HttpRequest) -> JsonResponse:
    """Live accelerator readings; the overview refreshes its table from this."""
    return JsonResponse({"accelerators": services.accelerator_readings()})


@login_required
def serving_json(request: HttpRequest) -> JsonResponse:
    """The live serving panel over ``?window=`` (5m, 1h, 24h) for the fleet, ``?deployment=
    <id>`` or ``?node=<name>``: the figures with their units, the charts, and the panel's
    body as HTML (what the page swaps in)."""
    deployment = node = None
    if "deployment" in request.GET:
        raw = request.GET["deployment"]
        if not raw.isdigit():
            raise Http404("no such deployment")
        deployment = get_object_or_404(Deployment, pk=int(raw))
    elif "node" in request.GET:
        node = get_object_or_404(Node, name=request.GET["node"])
    context = serving_context(request, deployment=deployment, node=node)
    data = dict(context["serving"])
    data.pop("figures", None)  # the charts again, as the template lists them
    data["html"] = render_to_string("dashboard/_serving_body.html", context, request=request)
    # Finite by construction (dashboard/live.py caps every measure); never NaN or Infinity.
    return JsonResponse(data, json_dumps_params={"allow_nan": False})
