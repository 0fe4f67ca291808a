"""The profile's CPU engine limit is ``cpu_max_num_seqs`` (its --max-num-seqs), so it no longer
shares a name with the policy's ``cpu_max_batch_size`` (router admission)."""

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0004_placement_and_replicas"),
    ]

    operations = [
        migrations.RenameField(
            model_name="deploymentprofile",
            old_name="cpu_max_batch_size",
            new_name="cpu_max_num_seqs",
        ),
        migrations.AlterField(
            model_name="deploymentprofile",
            name="cpu_max_num_seqs",
            field=models.PositiveIntegerField(
                default=8,
                help_text=(
                    "the CPU engine's --max-num-seqs; the router admits at most this many decodes"
                ),
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(4096),
                ],
            ),
        ),
    ]
