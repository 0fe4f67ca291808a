"""Profiles: the list, a profile's page (every setting, its engines as the agent would start
them, where it fits) and the form that creates or changes one."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from common.errors import FieldError
from controlplane.dashboard.profile_forms import ProfileForm, judge, settings_of
from controlplane.dashboard.views.common import require_perm
from controlplane.deployments.masking import may_see_env
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.deployments.placement import (
    ACTIVE,
    NoPlacement,
    PlacementError,
    check_placement,
    placement_plan,
)
from controlplane.deployments.placement.claims import constraints_for, node_views
from controlplane.deployments.placement.scheduler import choose as choose_node
from controlplane.deployments.render import render_profile
from controlplane.deployments.services import save_profile
from controlplane.inventory.models import Node


@login_required
def profile_list(request: HttpRequest) -> HttpResponse:
    profiles = DeploymentProfile.objects.annotate(deployment_count=Count("deployments"))
    return render(request, "dashboard/profile_list.html", {"profiles": profiles})


@dataclass
class NodeFit:
    """Could a deployment of the profile start on ``node`` now, were the profile's own
    deployments (``own``) not there: they are what a redeploy of it replaces."""

    node: Node
    fits: bool
    reasons: list[str] = field(default_factory=list)  # why not, each naming its setting
    detail: str = ""  # where it fits: the cards and cores it would get
    own: list[Deployment] = field(default_factory=list)


def node_fit(profile: DeploymentProfile, node: Node, own: list[Deployment]) -> NodeFit:
    """The placement's own checks, in its order: the profile against the node's hardware,
    then the cards and ports the other deployments leave free (the scheduler's rules), then
    the CPU engine's cores."""
    problems = check_placement(profile, node)
    if problems:
        return NodeFit(node, False, [f"{p.field}: {p.message}" for p in problems], own=own)
    draft = Deployment(profile=profile, node=node, pinned=True)
    (view,) = node_views(draft, [node], free_of_profile=True)
    try:
        # A pinned deployment goes to its node whatever its heartbeat says (draining is
        # check_placement's); the status is shown beside the answer.
        choice = choose_node([replace(view, status="online")], constraints_for(draft))
    except NoPlacement as exc:
        return NodeFit(node, False, [f"{exc.field}: {exc.message}"], own=own)
    try:
        plan = placement_plan(profile, node)
    except PlacementError as exc:
        return NodeFit(node, False, [f"{p.field}: {p.message}" for p in exc.problems], own=own)
    cards = len(choice.cards)
    detail = f"{cards} card{'s' if cards != 1 else ''}"
    if plan.get("cpuset"):
        detail += (
            f"; the CPU engine on cores {plan['cpuset']} ({plan['physical_cores']} physical, "
            f"OMP_NUM_THREADS {plan['omp_num_threads']})"
        )
    return NodeFit(node, True, detail=detail, own=own)


@login_required
def profile_detail(request: HttpRequest, name: str) -> HttpResponse:
    profile = get_object_or_404(DeploymentProfile, name=name)
    nodes = list(
        Node.objects.select_related("cpu")
        .prefetch_related("accelerators", "numa_nodes")
        .order_by("name")
    )
    deployments = list(profile.deployments.select_related("node").order_by("name"))
    active: dict[int, list[Deployment]] = {}
    for deployment in deployments:
        if deployment.state in ACTIVE:
            active.setdefault(deployment.node_id, []).append(deployment)
    fits = [node_fit(profile, node, active.get(node.pk, [])) for node in nodes]
    wanted = request.GET.get("node", "")
    node = next((n for n in nodes if n.name == wanted), None)
    if node is None and not wanted:
        if len(nodes) == 1:
            node = nodes[0]
        elif deployments:
            node = next((n for n in nodes if n.pk == deployments[0].node_id), None)
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
        "groups": settings_of(profile, show_secrets=show_secrets),
        "show_secrets": show_secrets,
        "deployments": deployments,
        "fits": fits,
        "nodes": nodes,
        "node": node,
        "unknown_node": wanted if wanted and node is None else "",
        "renders": renders,
        "may_edit": request.user.has_perm("deployments.change_deploymentprofile"),
    }
    return render(request, "dashboard/profile_detail.html", context)


def _edit(request: HttpRequest, profile: DeploymentProfile | None) -> HttpResponse:
    form = ProfileForm(request.POST or None, instance=profile)
    status = 200
    if request.method == "POST":
        values = judge(form)
        if values is not None:
            saved = save_profile(profile, values, acting_user=request.user)
            uses = saved.deployments.count()
            note = (
                f"; {uses} deployment(s) use it: each starts from the new settings on its "
                "next deploy"
                if profile is not None and uses
                else ""
            )
            verb = "created" if profile is None else "saved"
            messages.success(request, f"profile {saved.name} {verb}{note}")
            return redirect("dashboard:profile", name=saved.name)
        status = 400
    context = {"form": form, "profile": profile}
    return render(request, "dashboard/profile_form.html", context, status=status)


@require_perm("deployments.add_deploymentprofile")
def profile_create(request: HttpRequest) -> HttpResponse:
    return _edit(request, None)


@require_perm("deployments.change_deploymentprofile")
def profile_edit(request: HttpRequest, name: str) -> HttpResponse:
    return _edit(request, get_object_or_404(DeploymentProfile, name=name))
