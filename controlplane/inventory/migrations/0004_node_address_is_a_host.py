"""A node's address is a host name or an IP literal (common/hosts.py).

It was free text an agent chose, and routers, benchmarks and the agents' own probes send
traffic to ``http://<address>:<port>``: ``10.0.0.5:22#`` aimed that anywhere. Reports are
checked from now on; a row stored before is blanked here, so no such address is used again
(a node with none counts as one that reported none). Its inventory hash is blanked with it:
the next heartbeat's answer then differs from the agent's hash, the agent sends its
inventory again, and that report is checked (the machine gateway answers a report whose hash
is the stored one without reading it).
"""

from django.db import migrations, models

import controlplane.inventory.models
from common.hosts import is_host


def blank_bad_addresses(apps, schema_editor):  # type: ignore[no-untyped-def]
    Node = apps.get_model("inventory", "Node")
    bad = [
        pk
        for pk, address in Node.objects.exclude(address="").values_list("pk", "address")
        if not is_host(address)
    ]
    Node.objects.filter(pk__in=bad).update(address="", inventory_hash="")


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0003_heartbeat_node_index_fillfactor"),
    ]

    operations = [
        migrations.AlterField(
            model_name="node",
            name="address",
            field=models.CharField(
                blank=True,
                help_text="host name or IP address the router uses to reach its engines",
                max_length=255,
                validators=[controlplane.inventory.models.validate_node_address],
            ),
        ),
        migrations.RunPython(blank_bad_addresses, migrations.RunPython.noop),
    ]
