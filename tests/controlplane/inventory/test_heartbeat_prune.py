"""The heartbeat history is pruned in batches, through its own time index on PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

from django.db import connection
from django.utils import timezone

from controlplane.inventory import services
from controlplane.inventory.models import Heartbeat


def test_expired_heartbeats_go_in_batches_and_recent_ones_stay(node) -> None:
    now = timezone.now()
    Heartbeat.objects.bulk_create(
        [Heartbeat(node=node, received_at=now - timedelta(hours=30, seconds=i)) for i in range(25)]
        + [Heartbeat(node=node, received_at=now - timedelta(minutes=i)) for i in range(3)]
    )
    assert services.prune_heartbeats(24, batch=10) == 25
    assert Heartbeat.objects.count() == 3
    assert services.prune_heartbeats(24, batch=10) == 0


def test_postgresql_finds_them_through_a_brin_index(db) -> None:
    if connection.vendor != "postgresql":
        # The embedded SQLite database has no BRIN; the migration leaves it without one.
        assert "heartbeat_received_brin" not in str(
            connection.introspection.get_constraints(connection.cursor(), "inventory_heartbeat")
        )
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'heartbeat_received_brin'"
        )
        (definition,) = cursor.fetchone()
    assert "USING brin (received_at)" in definition
