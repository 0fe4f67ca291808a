from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from controlplane.dashboard import services


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/overview.html", services.overview())


@login_required
def accelerators_json(request: HttpRequest) -> JsonResponse:
    """Live accelerator readings; the overview refreshes its table from this."""
    return JsonResponse({"accelerators": services.accelerator_readings()})
