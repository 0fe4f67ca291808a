"""Room in each page for heartbeat updates, and one index fewer on every heartbeat's insert.

Every heartbeat rewrites its node's row and its cards' rows. PostgreSQL can write the new
version of a row into the page that holds the old one, and then updates no index (a HOT
update), only when that page has room. At the default fill factor (100) a table loaded at
once has none, so the first update of each row writes every index of the node (six) or card
(four); later ones find room where pruning freed the dead versions, for a node nearly
always, for a card 95-97 % of the time (``scripts/bench/heartbeat_write_timing.py``). A fill
factor leaves room in every page written from now on: half of each node page (the rows are
small and few) and 30 % of each card page, which makes every card update HOT. Pages written
before keep what they have until their rows move
(docs/decisions/0036-group-commits-one-statement.md).

The heartbeat's own index on ``node_id`` repeated the first column of
``heartbeat_node_time_idx``, which serves every lookup by node; it is dropped.

Fill factors are PostgreSQL's; the embedded SQLite database gets only the index change.
"""

import django.db.models.deletion
from django.db import migrations, models

FILL = {"inventory_node": 50, "inventory_accelerator": 70}


def fill(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        for table, percent in FILL.items():
            schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = {percent})")


def unfill(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        for table in FILL:
            schema_editor.execute(f"ALTER TABLE {table} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("inventory", "0002_heartbeat_received_at_brin")]

    operations = [
        migrations.AlterField(
            model_name="heartbeat",
            name="node",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="heartbeats",
                to="inventory.node",
            ),
        ),
        migrations.RunPython(fill, unfill),
    ]
