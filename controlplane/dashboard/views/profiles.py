"""A profile's page: its engines as the agent would start them, for copying to a shell."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from common.errors import FieldError
from controlplane.deployments.masking import may_see_env
from controlplane.deployments.models import DeploymentProfile
from controlplane.deployments.render import render_profile
from controlplane.inventory.models import Node


@login_required
def profile_detail(request: HttpRequest, name: str) -> HttpResponse:
    profile = get_object_or_404(DeploymentProfile, name=name)
    nodes = list(Node.objects.order_by("name"))
    wanted = request.GET.get("node", "")
    node = next((n for n in nodes if n.name == wanted), None)
    if node is None and not wanted and len(nodes) == 1:
        node = nodes[0]
    # The profile's own env may hold tokens: only people who may change profiles see them.
    show_secrets = may_see_env(request.user)
    renders = {}
    for kind, docker in (("process", False), ("docker", True)):
        try:
            renders[kind] = {
                "text": render_profile(profile, node, docker=docker, show_secrets=show_secrets).text
            }
        except FieldError as exc:
            renders[kind] = {"error": str(exc)}
    context = {
        "profile": profile,
        "nodes": nodes,
        "node": node,
        "unknown_node": wanted if wanted and node is None else "",
        "renders": renders,
    }
    return render(request, "dashboard/profile_detail.html", context)
