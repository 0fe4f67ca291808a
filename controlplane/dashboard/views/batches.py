"""Batches (OpenAI's Batch API, docs/batches.md): every tenant's batches with their progress,
and one batch's page. Read-only: clients create and cancel batches through the API; the page
refreshes itself while a batch is still moving."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from controlplane.batches.choices import UNFINISHED_STATUSES, BatchStatus, LineStatus
from controlplane.batches.models import Batch, BatchLine

# Batches a page lists, newest first, and failed lines shown on a batch's page.
LIST_LIMIT = 200
FAILED_SHOWN = 50


def _progress(batch: Batch) -> dict[str, Any]:
    percent = 100.0 * batch.finished / batch.total if batch.total else 0.0
    active = batch.status in UNFINISHED_STATUSES
    return {"batch": batch, "percent": round(percent), "active": active}


@login_required
def batch_list(request: HttpRequest) -> HttpResponse:
    status = request.GET.get("status", "")
    owner = request.GET.get("owner", "")
    batches = Batch.objects.all()
    if status in BatchStatus.values:
        batches = batches.filter(status=status)
    if owner:
        batches = batches.filter(owner=owner)
    rows = [_progress(b) for b in batches.order_by("-created_at")[:LIST_LIMIT]]
    counts = dict(
        Batch.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n")
    )
    context = {
        "rows": rows,
        "status": status,
        "owner": owner,
        "statuses": [(s.value, s.label, counts.get(s.value, 0)) for s in BatchStatus],
        "refresh": any(row["active"] for row in rows),
        "limit": LIST_LIMIT,
    }
    return render(request, "dashboard/batch_list.html", context)


@login_required
def batch_detail(request: HttpRequest, batch_id: str) -> HttpResponse:
    batch = get_object_or_404(Batch, pk=batch_id)
    lines = BatchLine.objects.filter(batch=batch)
    by_status = lines.aggregate(
        pending=Count("id", filter=Q(status=LineStatus.PENDING)),
        done=Count("id", filter=Q(status=LineStatus.DONE)),
        failed=Count("id", filter=Q(status=LineStatus.FAILED)),
    )
    failed = lines.filter(status=LineStatus.FAILED).order_by("line_no")[:FAILED_SHOWN]
    timeline = [
        (label, getattr(batch, field))
        for label, field in (
            ("created", "created_at"),
            ("in progress", "in_progress_at"),
            ("finalizing", "finalizing_at"),
            ("completed", "completed_at"),
            ("failed", "failed_at"),
            ("cancelling", "cancelling_at"),
            ("cancelled", "cancelled_at"),
            ("expired", "expired_at"),
        )
        if getattr(batch, field) is not None
    ]
    context = {
        **_progress(batch),
        "lines": by_status,
        "failed": failed,
        "failed_shown": FAILED_SHOWN,
        "timeline": timeline,
        "refresh": batch.status in UNFINISHED_STATUSES,
    }
    return render(request, "dashboard/batch_detail.html", context)
