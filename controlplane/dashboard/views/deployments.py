from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlplane.dashboard import services as reads
from controlplane.dashboard.forms import DeploymentCreateForm
from controlplane.dashboard.views.common import int_param, require_perm
from controlplane.dashboard.views.overview import serving_context
from controlplane.dashboard.views.playground import PlaygroundForm, live_router
from controlplane.deployments import services
from controlplane.deployments.models import Deployment
from controlplane.deployments.placement import PlacementError, check_placement

# The operator's three buttons, each one service call.
ACTIONS = {
    "deploy": services.request_deploy,
    "stop": services.request_stop,
    "restart": services.request_restart,
}


@login_required
def deployment_list(request: HttpRequest) -> HttpResponse:
    deployments = Deployment.objects.select_related("node", "profile", "policy")
    return render(
        request,
        "dashboard/deployment_list.html",
        {"deployments": deployments, "form": DeploymentCreateForm()},
    )


@require_perm("deployments.add_deployment")
def deployment_create(request: HttpRequest) -> HttpResponse:
    form = DeploymentCreateForm(request.POST or None)
    data = form.cleaned_data if form.is_bound and not form.is_valid() else {}
    if data.get("profile") and "node" in data and (data["node"] or "node_selector" in data):
        # The form refused a field: placement is judged too, so one round shows every problem.
        node, labels = data["node"], data.get("node_selector") or {}
        for problem in reads.placement_problems(data["profile"], node, labels):
            form.add_service_error(problem.field, problem.message)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            deployment = services.create_deployment(
                name=data["name"],
                profile=data["profile"],
                node=data["node"],
                policy=data["policy"],
                acting_user=request.user,
                start=data["start"],
                **({"node_selector": data["node_selector"]} if data["node"] is None else {}),
            )
        except PlacementError as exc:
            # Show every reason the profile does not fit, not only the first one raised.
            for problem in exc.problems:
                form.add_service_error(problem.field, problem.message)
        else:
            messages.success(request, f"deployment {deployment.name} created")
            return redirect("dashboard:deployment", pk=deployment.pk)
    status = 400 if request.method == "POST" else 200
    return render(request, "dashboard/deployment_form.html", {"form": form}, status=status)


@login_required
def deployment_detail(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(
        Deployment.objects.select_related("node", "profile", "policy"), pk=pk
    )
    timeline = reads.timeline(deployment)
    context = {
        "deployment": deployment,
        "timeline": timeline,
        "last_event_id": timeline["events"][-1]["id"] if timeline["events"] else 0,
        "containers": deployment.containers.order_by("-generation", "role")[:6],
        "problems": check_placement(deployment.profile, deployment.node),
        "playground_form": PlaygroundForm(),
        "playground_router": live_router(),
        **serving_context(request, deployment=deployment),
    }
    return render(request, "dashboard/deployment_detail.html", context)


@require_POST
@require_perm("deployments.change_deployment")
def deployment_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    operation = ACTIONS.get(action)
    if operation is None:
        raise Http404("no such action")
    deployment = get_object_or_404(Deployment.objects.select_related("node", "profile"), pk=pk)
    try:
        operation(deployment, acting_user=request.user)
    except PlacementError as exc:
        messages.error(request, f"{action} refused: {exc.field}: {exc.message}")
    else:
        messages.success(request, f"{action} requested for {deployment.name}")
    return redirect("dashboard:deployment", pk=pk)


@login_required
def deployment_timeline(request: HttpRequest, pk: int) -> JsonResponse:
    """The state and the events after ``?after=<event id>``; the page polls this."""
    deployment = get_object_or_404(Deployment, pk=pk)
    return JsonResponse(reads.timeline(deployment, after=int_param(request, "after")))
