from django.db import migrations

# MISSION.md's three scenarios: short chat, medium generation, long context.
BUILTIN = [
    ("short", "chat (MISSION.md)", 128, 256, 1, 16),
    ("medium", "generation (MISSION.md)", 512, 1024, 1, 8),
    ("long", "long context (MISSION.md)", 2048, 512, 1, 4),
]


def add(apps, schema_editor):
    Scenario = apps.get_model("benchmarks", "Scenario")
    for name, description, tokens_in, tokens_out, lo, hi in BUILTIN:
        Scenario.objects.update_or_create(
            name=name,
            defaults=dict(
                description=description,
                input_tokens=tokens_in,
                output_tokens=tokens_out,
                concurrency_min=lo,
                concurrency_max=hi,
                builtin=True,
            ),
        )


def remove(apps, schema_editor):
    apps.get_model("benchmarks", "Scenario").objects.filter(builtin=True).delete()


class Migration(migrations.Migration):
    dependencies = [("benchmarks", "0001_initial")]
    operations = [migrations.RunPython(add, remove)]
