from django.db import migrations


def add(apps, schema_editor):
    Policy = apps.get_model("policy", "SchedulingPolicy")
    Revision = apps.get_model("policy", "PolicyRevision")
    policy, created = Policy.objects.get_or_create(name="default")
    if created:
        knobs = {
            f.name: getattr(policy, f.name)
            for f in Policy._meta.concrete_fields
            if f.name not in ("id", "name", "description", "version", "created_at", "updated_at")
        }
        Revision.objects.create(
            policy=policy,
            version=policy.version,
            knobs=knobs,
            reason="initial defaults (sysHAX example configuration)",
            created_by_label="system",
        )


class Migration(migrations.Migration):
    dependencies = [("policy", "0001_initial")]
    operations = [migrations.RunPython(add, migrations.RunPython.noop)]
