import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="BatchFileChunk",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("index", models.PositiveIntegerField()),
                ("data", models.BinaryField()),
                (
                    "file",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="chunks",
                        to="batches.batchfile",
                    ),
                ),
            ],
            options={
                "ordering": ["file", "index"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("file", "index"), name="batchfilechunk_unique_index"
                    )
                ],
            },
        ),
    ]
