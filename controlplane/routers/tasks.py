from __future__ import annotations

from celery import shared_task
from django.conf import settings

from controlplane.routers import services


@shared_task(name="routers.prune_samples", ignore_result=True)
def prune_samples() -> int:
    return services.prune_samples(settings.ROUTER_STATS_RETENTION_HOURS)
