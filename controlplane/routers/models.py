from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from controlplane.access.models import MachineCredential


class RouterInstance(models.Model):
    """A router process that registered with its router token."""

    name = models.CharField(max_length=100, unique=True)
    credential = models.ForeignKey(
        MachineCredential, on_delete=models.CASCADE, related_name="routers"
    )
    version = models.CharField(max_length=64, blank=True)
    listen_url = models.CharField(max_length=255, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    policy_version = models.PositiveIntegerField(null=True, blank=True)
    request_rate = models.FloatField(default=0.0)
    stats = models.JSONField(default=dict, blank=True, help_text="the latest report")
    usage_reported_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when its last tenant usage report was accepted: bounds what the next may "
        "claim (controlplane/tenants/usage.py)",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_alive(self) -> bool:
        if self.last_seen_at is None:
            return False
        grace = timedelta(seconds=settings.ROUTER_GRACE_SECONDS)
        return timezone.now() - self.last_seen_at <= grace


class RouterStatsSample(models.Model):
    """One stats report: the history behind the dashboard's serving panels; pruned after
    ROUTER_STATS_RETENTION_HOURS (``routers.prune_samples``)."""

    router = models.ForeignKey(RouterInstance, on_delete=models.CASCADE, related_name="samples")
    received_at = models.DateTimeField(default=timezone.now)
    request_rate = models.FloatField(default=0.0)
    decisions = models.JSONField(default=dict, blank=True)
    policy_version = models.PositiveIntegerField(null=True, blank=True)
    serving = models.JSONField(
        default=dict,
        blank=True,
        help_text="what happened since the router's previous report (common/serving.py): "
        "decisions and reasons, TTFT and TPOT histograms, each deployment's engines",
    )

    class Meta:
        ordering = ["-received_at"]
        indexes = [
            models.Index(fields=["router", "-received_at"], name="router_sample_time_idx"),
            # The dashboard's windows over every router, and the prune.
            models.Index(fields=["received_at"], name="router_sample_received_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.router} @ {self.received_at:%H:%M:%S}"
