from __future__ import annotations

from celery import shared_task
from django.conf import settings

from controlplane.inventory import services


@shared_task(name="inventory.reap_lost_nodes", ignore_result=True)
def reap_lost_nodes() -> list[int]:
    return services.mark_lost_nodes()


@shared_task(name="inventory.prune_heartbeats", ignore_result=True)
def prune_heartbeats() -> int:
    return services.prune_heartbeats(settings.HEARTBEAT_RETENTION_HOURS)
