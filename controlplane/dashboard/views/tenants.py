"""Tenants: the list (with last hour's usage and the form for a new one), and a tenant's page:
its settings, its keys (issue one, shown once; revoke), and its usage over a window."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from common.errors import FieldError
from controlplane.core.services import DeleteRefused
from controlplane.dashboard import charts
from controlplane.dashboard.tenant_forms import IssueKeyForm, TenantForm
from controlplane.dashboard.views.common import require_perm
from controlplane.tenants import services
from controlplane.tenants.choices import REJECT_REASONS, USAGE_WINDOWS
from controlplane.tenants.models import Tenant, TenantKey
from controlplane.tenants.usage import Usage, usage_series, usage_totals

# How each window is drawn: minutes a point, and the unit of the x axis in minutes.
BUCKETS = {"5m": (1, 1, "minutes from now"), "1h": (5, 1, "minutes from now")}
BUCKETS["24h"] = (60, 60, "hours from now")


def _tenants() -> Any:
    return Tenant.objects.annotate(
        active_key_count=Count("keys", filter=Q(keys__revoked_at__isnull=True))
    )


def _list_page(request: HttpRequest, form: TenantForm, status: int = 200) -> HttpResponse:
    tenants = list(_tenants())
    totals = usage_totals(tenants, timedelta(hours=1))
    rows = [(tenant, totals[tenant.pk]) for tenant in tenants]
    context = {"rows": rows, "form": form, "may_add": request.user.has_perm("tenants.add_tenant")}
    return render(request, "dashboard/tenant_list.html", context, status=status)


@login_required
def tenant_list(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _list_page(request, TenantForm())
    if not request.user.has_perm("tenants.add_tenant"):
        raise PermissionDenied("needs tenants.add_tenant")
    form = TenantForm(request.POST)
    values = form.judge()
    if values is None:
        return _list_page(request, form, status=400)
    tenant = services.save_tenant(None, values, acting_user=request.user)
    messages.success(request, f"tenant {tenant.name} created; issue it a key below")
    return redirect("dashboard:tenant", name=tenant.name)


def usage_charts(series: list[tuple[datetime, Usage]], window: str) -> dict[str, Any]:
    """The window's charts and the table beside them: per bucket (a point of the chart), the
    mean requests and tokens a minute and the rejections by reason."""
    size, unit, x_label = BUCKETS[window]
    buckets: list[tuple[float, datetime, Usage]] = []
    for start in range(0, len(series), size):
        chunk = series[start : start + size]
        total = Usage()
        for _, counts in chunk:
            total.add(counts)
        # x: where the bucket ends, in units before now (0: the current minute).
        x = -float(len(series) - start - len(chunk)) / unit + 0.0  # + 0.0: never "-0"
        buckets.append((x, chunk[0][0], total))
    reasons = [r for r in REJECT_REASONS if any(u.rejected.get(r) for _, _, u in buckets)]
    per = float(size)
    title = f"over the last {window}"
    return {
        "buckets": [(when, size, u) for _, when, u in buckets],
        "reasons": reasons,
        "requests_chart": charts.line_chart(
            {"requests": [(x, u.requests / per) for x, _, u in buckets]},
            title=f"Requests a minute {title}",
            x_label=x_label,
            y_label="requests/min",
        ),
        "tokens_chart": charts.line_chart(
            {
                "prompt": [(x, u.prompt_tokens / per) for x, _, u in buckets],
                "completion": [(x, u.completion_tokens / per) for x, _, u in buckets],
            },
            title=f"Tokens a minute {title}",
            x_label=x_label,
            y_label="tokens/min",
        ),
        "rejections_chart": charts.line_chart(
            {r: [(x, float(u.rejected.get(r, 0))) for x, _, u in buckets] for r in reasons},
            title=f"Rejections by reason {title}",
            x_label=x_label,
            y_label=f"rejections per {size} min",
        )
        if reasons
        else "",
    }


def _detail_page(
    request: HttpRequest,
    tenant: Tenant,
    *,
    form: TenantForm | None = None,
    key_form: IssueKeyForm | None = None,
    new_key: tuple[TenantKey, str] | None = None,
    status: int = 200,
) -> HttpResponse:
    window = request.GET.get("window", "1h")
    if window not in USAGE_WINDOWS:
        window = "1h"
    series = usage_series(tenant, window)
    totals = Usage()
    for _, counts in series:
        totals.add(counts)
    user = request.user
    context = {
        "tenant": tenant,
        "form": form or TenantForm(tenant=tenant),
        "key_form": key_form or IssueKeyForm(),
        "new_key": new_key,
        "keys": list(tenant.keys.select_related("created_by")),
        "window": window,
        "windows": list(USAGE_WINDOWS),
        "totals": totals,
        "may_change": user.has_perm("tenants.change_tenant"),
        "may_issue": user.has_perm("tenants.add_tenantkey"),
        "may_revoke": user.has_perm("tenants.change_tenantkey"),
        "may_delete": user.has_perm("tenants.delete_tenant"),
        **usage_charts(series, window),
    }
    response = render(request, "dashboard/tenant_detail.html", context, status=status)
    if new_key is not None:
        response["Cache-Control"] = "no-store"  # the key is on this page, and only here
    return response


@login_required
def tenant_detail(request: HttpRequest, name: str) -> HttpResponse:
    tenant = get_object_or_404(_tenants(), name=name)
    if request.method != "POST":
        return _detail_page(request, tenant)
    if not request.user.has_perm("tenants.change_tenant"):
        raise PermissionDenied("needs tenants.change_tenant")
    form = TenantForm(request.POST, tenant=tenant)
    values = form.judge()
    if values is None:
        return _detail_page(request, tenant, form=form, status=400)
    services.save_tenant(tenant, values, acting_user=request.user)
    messages.success(request, f"tenant {tenant.name} saved; routers apply it at their next poll")
    return redirect("dashboard:tenant", name=tenant.name)


@require_POST
@require_perm("tenants.add_tenantkey")
def tenant_issue_key(request: HttpRequest, name: str) -> HttpResponse:
    """Answers with the tenant's page showing the new key, once: it is not stored, so neither a
    redirect nor a message (kept in the session or a cookie until shown) carries it."""
    tenant = get_object_or_404(_tenants(), name=name)
    form = IssueKeyForm(request.POST)
    if not form.is_valid():
        return _detail_page(request, tenant, key_form=form, status=400)
    try:
        issued = services.issue_key(tenant, form.cleaned_data["label"], acting_user=request.user)
    except FieldError as exc:
        form.add_problem(exc.field, exc.message)
        return _detail_page(request, tenant, key_form=form, status=400)
    return _detail_page(request, tenant, new_key=issued)


@require_POST
@require_perm("tenants.change_tenantkey")
def tenant_revoke_key(request: HttpRequest, name: str, key_id: int) -> HttpResponse:
    key = get_object_or_404(
        TenantKey.objects.select_related("tenant"), pk=key_id, tenant__name=name
    )
    if services.revoke_key(key, acting_user=request.user):
        messages.success(
            request, f"key {key.prefix}… revoked; routers refuse it from their next poll"
        )
    else:
        messages.info(request, f"key {key.prefix}… was revoked already")
    return redirect("dashboard:tenant", name=name)


@require_POST
@require_perm("tenants.delete_tenant")
def tenant_delete(request: HttpRequest, name: str) -> HttpResponse:
    tenant = get_object_or_404(Tenant, name=name)
    try:
        services.delete_tenant(tenant, acting_user=request.user)
    except DeleteRefused as exc:
        messages.error(request, f"tenant {name} kept: {exc}")
        return redirect("dashboard:tenant", name=name)
    messages.success(request, f"tenant {name} deleted with its keys and usage")
    return redirect("dashboard:tenants")
