"""A BRIN index on heartbeat time, for the hourly prune
(docs/decisions/0028-fleet-paths-through-django.md).

Heartbeats are appended in time order, so a block-range index finds the expired ones at a
fraction of a B-tree's size and adds almost nothing to each heartbeat's insert. BRIN is
PostgreSQL's; the embedded SQLite database serves one machine's handful of nodes and gets no
index here.
"""

from django.db import migrations

INDEX = "heartbeat_received_brin"


def create(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {INDEX} ON inventory_heartbeat "
            "USING brin (received_at)"
        )


def drop(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    dependencies = [("inventory", "0001_initial")]

    operations = [migrations.RunPython(create, drop)]
