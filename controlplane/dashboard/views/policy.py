from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from common.policy_schema import PolicyError
from controlplane.dashboard import services as reads
from controlplane.dashboard.forms import PolicyForm
from controlplane.dashboard.views.common import require_perm
from controlplane.policy import services
from controlplane.policy.models import KNOB_NAMES, SchedulingPolicy


def ordered_diff(changed: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(knob, old, new) in the schema's knob order (a JSON column need not keep key order)."""
    known = [name for name in KNOB_NAMES if name in changed]
    rest = sorted(set(changed) - set(known))
    return [(name, *changed[name]) for name in known + rest if len(changed[name]) == 2]


@login_required
def policy_index(request: HttpRequest) -> HttpResponse:
    policy = services.ensure_default_policy()
    others = SchedulingPolicy.objects.exclude(pk=policy.pk)
    if not others.exists():
        return redirect("dashboard:policy", name=policy.name)
    policies = SchedulingPolicy.objects.all()
    return render(request, "dashboard/policy_list.html", {"policies": policies})


def _page(
    request: HttpRequest, policy: SchedulingPolicy, form: PolicyForm, status: int = 200
) -> HttpResponse:
    revisions = list(policy.revisions.select_related("created_by")[:30])
    diffs = {rev.pk: ordered_diff(rev.changed) for rev in revisions}
    context = {
        "policy": policy,
        "form": form,
        "revisions": revisions,
        "diffs": diffs,
        "rollout": reads.policy_rollout(policy),
    }
    return render(request, "dashboard/policy_detail.html", context, status=status)


@login_required
def policy_detail(request: HttpRequest, name: str) -> HttpResponse:
    policy = get_object_or_404(SchedulingPolicy, name=name)
    if request.method != "POST":
        return _page(request, policy, PolicyForm(initial=policy.knobs()))
    if not request.user.has_perm("policy.change_schedulingpolicy"):
        raise PermissionDenied("needs policy.change_schedulingpolicy")
    form = PolicyForm(request.POST)
    # The reason and every knob that converted are judged together, so one round shows all.
    form.full_clean()
    reason = form.cleaned_data.get("reason")
    for error in services.change_errors(policy, changes=form.knob_values(), reason=reason):
        form.add_problem(error.field, error.message)
    if form.is_valid():
        try:
            revision = services.update_policy(
                policy,
                changes=form.knob_values(),
                acting_user=request.user,
                reason=form.cleaned_data["reason"],
            )
        except PolicyError as exc:
            form.add_problem(exc.field, exc.message)
        else:
            messages.success(request, f"policy {policy.name} saved as v{revision.version}")
            return redirect("dashboard:policy", name=policy.name)
    return _page(request, policy, form, status=400)


@require_POST
@require_perm("policy.change_schedulingpolicy")
def policy_rollback(request: HttpRequest, name: str) -> HttpResponse:
    policy = get_object_or_404(SchedulingPolicy, name=name)
    raw = request.POST.get("version", "")
    try:
        revision = services.rollback_policy(
            policy,
            to_version=int(raw) if raw.isdigit() else -1,
            acting_user=request.user,
            reason=request.POST.get("reason", "").strip(),
        )
    except PolicyError as exc:
        messages.error(request, f"rollback refused: {exc.message}")
    else:
        messages.success(
            request, f"policy {policy.name} rolled back to v{raw} (now v{revision.version})"
        )
    return redirect("dashboard:policy", name=policy.name)
