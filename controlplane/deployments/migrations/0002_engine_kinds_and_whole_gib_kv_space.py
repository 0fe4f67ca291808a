"""Engine kinds for upstream vLLM V1 and sysHAX's patched V0 image; whole GiB of CPU KV space.

Data first, while ``cpu_kv_cache_space_gb`` is still a float: fractions are rounded up (vLLM
reads ``VLLM_CPU_KVCACHE_SPACE`` with ``int()``, and rounding down could leave too little
room). A profile on ``vllm`` with ``pd_protocol: syshax`` could only ever have worked against
sysHAX's patched V0 image (upstream vLLM ignores sysHAX's fields), so it becomes
``syshax-v0`` and keeps the command line it had (docs/decisions/0011-engine-kinds.md).
"""

import math

import django.core.validators
from django.db import migrations, models


def forwards(apps, schema_editor):
    Profile = apps.get_model("deployments", "DeploymentProfile")
    for profile in Profile.objects.all():
        whole = max(1, math.ceil(profile.cpu_kv_cache_space_gb))
        if whole != profile.cpu_kv_cache_space_gb:
            Profile.objects.filter(pk=profile.pk).update(cpu_kv_cache_space_gb=whole)
    Profile.objects.filter(engine="vllm", pd_protocol="syshax").update(engine="syshax-v0")


def backwards(apps, schema_editor):
    Profile = apps.get_model("deployments", "DeploymentProfile")
    Profile.objects.filter(engine="syshax-v0").update(engine="vllm")


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(forwards, backwards),
        migrations.AlterField(
            model_name="deploymentprofile",
            name="cpu_kv_cache_space_gb",
            field=models.PositiveIntegerField(
                default=40,
                help_text="VLLM_CPU_KVCACHE_SPACE: whole GiB (vLLM reads it with int())",
                validators=[django.core.validators.MinValueValidator(1)],
            ),
        ),
        migrations.AlterField(
            model_name="deploymentprofile",
            name="engine",
            field=models.CharField(
                choices=[
                    ("vllm", "vLLM (upstream, V1 engine)"),
                    ("syshax-v0", "sysHAX's patched vLLM V0 image"),
                    ("simulator", "syshax sim (simulated engine)"),
                ],
                default="vllm",
                max_length=16,
            ),
        ),
        migrations.AlterField(
            model_name="deploymentprofile",
            name="pd_protocol",
            field=models.CharField(
                choices=[
                    ("vllm", "vLLM kv_transfer_params (KV through the syshax connector)"),
                    (
                        "syshax",
                        "sysHAX style (num_decode_tokens, generated_text, request_id_inference)",
                    ),
                ],
                default="vllm",
                help_text="how the router hands a prefilled request to the CPU engine",
                max_length=8,
            ),
        ),
        migrations.AlterField(
            model_name="deploymentprofile",
            name="preemption_mode",
            field=models.CharField(
                choices=[("swap", "swap (KV cache to host memory)"), ("recompute", "recompute")],
                default="swap",
                help_text="sysHAX's V0 engine (and the simulator in its sysHAX mode) only; "
                "upstream vLLM V1 always recomputes and has no such flag",
                max_length=10,
            ),
        ),
    ]
