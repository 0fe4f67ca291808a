from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from common.policy_schema import KNOBS, PolicyError, validate_knobs
from controlplane.core.models import TimeStampedModel
from controlplane.policy.choices import DeciderAlgorithm, PolicyMode, ReplicaPicker

KNOB_NAMES = tuple(knob.name for knob in KNOBS)


def _range(name: str) -> list[Any]:
    knob = next(k for k in KNOBS if k.name == name)
    validators: list[Any] = []
    if knob.minimum is not None:
        validators.append(MinValueValidator(knob.minimum))
    if knob.maximum is not None:
        validators.append(MaxValueValidator(knob.maximum))
    return validators


class SchedulingPolicy(TimeStampedModel):
    """The live PD knobs routers apply. Every change is a PolicyRevision (see services.py).

    The knob fields mirror ``common.policy_schema.PolicyKnobs``; a test pins that they agree.
    """

    name = models.SlugField(max_length=64, unique=True, default="default")
    description = models.TextField(blank=True)
    version = models.PositiveIntegerField(default=1, editable=False)

    mode = models.CharField(max_length=16, choices=PolicyMode.choices, default=PolicyMode.AUTO)
    algorithm = models.CharField(
        max_length=24, choices=DeciderAlgorithm.choices, default=DeciderAlgorithm.CAPACITY
    )
    enable_auto_pd_offload = models.BooleanField(default=True)
    max_num_seqs = models.PositiveIntegerField(default=256, validators=_range("max_num_seqs"))
    gpu_cache_threshold = models.FloatField(default=90.0, validators=_range("gpu_cache_threshold"))
    cpu_throughput_threshold = models.FloatField(
        default=10.0, validators=_range("cpu_throughput_threshold")
    )
    token_limit_multiplier = models.FloatField(
        default=4.0, validators=_range("token_limit_multiplier")
    )
    token_limit_min = models.PositiveIntegerField(default=10, validators=_range("token_limit_min"))
    token_limit_max = models.PositiveIntegerField(default=100, validators=_range("token_limit_max"))
    cpu_max_batch_size = models.PositiveIntegerField(
        default=8, validators=_range("cpu_max_batch_size")
    )
    cpu_decode_slo_ms = models.FloatField(default=100.0, validators=_range("cpu_decode_slo_ms"))
    gpu_decode_slo_ms = models.FloatField(default=50.0, validators=_range("gpu_decode_slo_ms"))
    gpu_max_temperature_c = models.FloatField(
        default=90.0, validators=_range("gpu_max_temperature_c")
    )
    cpu_max_memory_percent = models.FloatField(
        default=95.0, validators=_range("cpu_max_memory_percent")
    )
    max_queue_size = models.PositiveIntegerField(default=200, validators=_range("max_queue_size"))
    request_timeout_seconds = models.FloatField(
        default=600.0, validators=_range("request_timeout_seconds")
    )
    metrics_interval_seconds = models.FloatField(
        default=1.0, validators=_range("metrics_interval_seconds")
    )
    # SLO classes (common.policy_schema.SLO_CLASSES): each a group of knobs.
    class_aware = models.BooleanField(default=True)
    replica_choice = models.CharField(
        max_length=16, choices=ReplicaPicker.choices, default=ReplicaPicker.PREFIX
    )
    prefix_load_slack = models.FloatField(default=4.0, validators=_range("prefix_load_slack"))
    prefix_min_tokens = models.PositiveIntegerField(
        default=256, validators=_range("prefix_min_tokens")
    )
    interactive_ttft_ms = models.FloatField(
        default=1000.0, validators=_range("interactive_ttft_ms")
    )
    interactive_tpot_ms = models.FloatField(default=50.0, validators=_range("interactive_tpot_ms"))
    interactive_priority = models.PositiveIntegerField(
        default=0, validators=_range("interactive_priority")
    )
    interactive_sheddable = models.BooleanField(default=False)
    interactive_cpu_first = models.BooleanField(default=False)
    standard_ttft_ms = models.FloatField(default=3000.0, validators=_range("standard_ttft_ms"))
    standard_priority = models.PositiveIntegerField(
        default=1, validators=_range("standard_priority")
    )
    standard_sheddable = models.BooleanField(default=False)
    standard_cpu_first = models.BooleanField(default=False)
    batch_ttft_ms = models.FloatField(default=60000.0, validators=_range("batch_ttft_ms"))
    batch_tpot_ms = models.FloatField(default=300.0, validators=_range("batch_tpot_ms"))
    batch_priority = models.PositiveIntegerField(default=2, validators=_range("batch_priority"))
    batch_sheddable = models.BooleanField(default=True)
    batch_cpu_first = models.BooleanField(default=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "scheduling policies"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(token_limit_min__lte=models.F("token_limit_max")),
                name="policy_token_limit_min_le_max",
            ),
            models.CheckConstraint(
                condition=models.Q(gpu_cache_threshold__gte=0, gpu_cache_threshold__lte=100),
                name="policy_gpu_cache_threshold_percent",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def knobs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in KNOB_NAMES}

    def clean(self) -> None:
        try:
            validate_knobs(self.knobs())
        except PolicyError as exc:
            raise ValidationError({exc.field: exc.message}) from None

    @property
    def etag(self) -> str:
        return self.etag_for(self.pk, self.version)

    @staticmethod
    def etag_for(pk: int, version: int) -> str:
        return f'"policy-{pk}-v{version}"'


class PolicyRevision(models.Model):
    """One saved state of a policy: who changed it, when, why, and the full knob snapshot."""

    policy = models.ForeignKey(SchedulingPolicy, on_delete=models.CASCADE, related_name="revisions")
    version = models.PositiveIntegerField()
    knobs = models.JSONField()
    changed = models.JSONField(default=dict, blank=True, help_text="knob: [old, new]")
    reason = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_by_label = models.CharField(max_length=150, blank=True)
    rolled_back_to = models.PositiveIntegerField(
        null=True, blank=True, help_text="the earlier version this revision restored"
    )

    class Meta:
        ordering = ["policy", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["policy", "version"], name="revision_unique_version")
        ]

    def __str__(self) -> str:
        return f"{self.policy.name} v{self.version}"
