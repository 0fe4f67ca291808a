from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from controlplane.benchmarks.choices import (
    ACTIVE_STATUSES,
    CANCELLING,
    DEFAULT_CONCURRENCY,
    DEFAULT_ITERATIONS,
    BenchmarkMode,
    RunStatus,
)
from controlplane.deployments.models import Deployment

MAX_CONCURRENCY = 1024


class Scenario(models.Model):
    """A prompt/output shape and its concurrency range. The three of MISSION.md are built in."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=255, blank=True)
    input_tokens = models.PositiveIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(1048576)]
    )
    output_tokens = models.PositiveIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(1048576)]
    )
    concurrency_min = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    concurrency_max = models.PositiveIntegerField(
        default=8, validators=[MinValueValidator(1), MaxValueValidator(MAX_CONCURRENCY)]
    )
    builtin = models.BooleanField(default=False, editable=False)

    class Meta:
        ordering = ["input_tokens", "name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(concurrency_min__lte=models.F("concurrency_max")),
                name="scenario_concurrency_range",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.input_tokens}->{self.output_tokens})"

    def clean(self) -> None:
        if self.concurrency_min > self.concurrency_max:
            raise ValidationError(
                {"concurrency_min": f"must not exceed concurrency_max ({self.concurrency_max})"}
            )


def default_concurrency() -> list[int]:
    return list(DEFAULT_CONCURRENCY)


class BenchmarkRun(models.Model):
    name = models.CharField(max_length=128, blank=True)
    scenario = models.ForeignKey(Scenario, on_delete=models.PROTECT, related_name="runs")
    deployment = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="benchmark_runs"
    )
    target_url = models.URLField(blank=True, help_text="router or engine URL when no deployment")
    mode = models.CharField(
        max_length=8, choices=BenchmarkMode.choices, default=BenchmarkMode.HETERO
    )
    concurrency = models.JSONField(default=default_concurrency, help_text="list of levels")
    # A goodput sweep (docs/benchmarks.md, "Goodput at SLO") when request_rates is not empty.
    request_rates = models.JSONField(
        default=list,
        blank=True,
        help_text="ascending requests/s; a non-empty list makes the run a goodput sweep "
        "(open loop, the concurrency levels unused)",
    )
    slo_ttft_ms = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0.001)])
    slo_tpot_ms = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0.001)])
    slo_attainment = models.FloatField(
        default=90.0,
        validators=[MinValueValidator(0.001), MaxValueValidator(100)],
        help_text="percent of requests that must meet the SLOs for a rate to count",
    )
    find_max_goodput = models.BooleanField(
        default=False, help_text="bisect between the last rate meeting the target and the next"
    )
    iterations = models.PositiveIntegerField(
        default=DEFAULT_ITERATIONS, validators=[MinValueValidator(1), MaxValueValidator(100000)]
    )
    warmup = models.PositiveIntegerField(default=0, validators=[MaxValueValidator(10000)])
    seed = models.PositiveIntegerField(default=0)
    status = models.CharField(
        max_length=10, choices=RunStatus.choices, default=RunStatus.QUEUED, db_index=True
    )
    progress = models.FloatField(
        default=0.0, validators=[MinValueValidator(0), MaxValueValidator(1)]
    )
    # What the run does now and how far it got, written by the runner as it goes: a point is
    # one (mode, concurrency) row, or one (mode, rate) row of a sweep.
    phase = models.CharField(max_length=200, blank=True)
    points_done = models.PositiveIntegerField(default=0)
    points_total = models.PositiveIntegerField(default=0)
    eta_at = models.DateTimeField(
        null=True, blank=True, help_text="when the run should end, from its points so far"
    )
    # The load generator's JSON; while the run is active (and after a cancel or failure) it
    # holds the points finished so far, with "partial": true.
    summary = models.JSONField(default=dict, blank=True)
    # What the run ran under: the deployment's policy (name, version at start, every version
    # seen while it ran), its profile (name, fingerprint, updated_at) and the engines.
    recorded_under = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    is_baseline = models.BooleanField(default=False)
    regression_threshold_percent = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0), MaxValueValidator(1000)],
        help_text="compare with the deployment's baseline run; empty: no comparison",
    )
    regression = models.BooleanField(default=False, db_index=True)
    regression_detail = models.JSONField(default=dict, blank=True)
    schedule = models.ForeignKey(
        "django_celery_beat.PeriodicTask",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="benchmark_runs",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=~(models.Q(deployment__isnull=True) & models.Q(target_url="")),
                name="run_has_deployment_or_target",
            )
        ]

    def __str__(self) -> str:
        return self.name or f"run {self.pk} ({self.scenario.name}, {self.mode})"

    @property
    def state(self) -> str:
        """The one state every page shows (badge, banner, Cancel button): the status, or
        "cancelling" while a running run's cancel has been requested."""
        if self.status == RunStatus.RUNNING and self.cancel_requested:
            return CANCELLING
        return str(self.status)

    @property
    def cancellable(self) -> bool:
        return self.status in ACTIVE_STATUSES and not self.cancel_requested

    @property
    def partial(self) -> bool:
        """A run that ended before all its points and kept the finished ones (the runner
        marks such a summary "partial")."""
        return self.status not in ACTIVE_STATUSES and bool(
            isinstance(self.summary, dict) and self.summary.get("partial")
        )

    def clean(self) -> None:
        errors: dict[str, str] = {}
        levels = self.concurrency
        if not isinstance(levels, list) or not levels:
            errors["concurrency"] = "must be a non-empty list of integers"
        elif not all(isinstance(c, int) and not isinstance(c, bool) for c in levels):
            errors["concurrency"] = "must be a list of integers"
        elif min(levels) < 1 or max(levels) > MAX_CONCURRENCY:
            errors["concurrency"] = f"each level must be between 1 and {MAX_CONCURRENCY}"
        if self.deployment_id is None and not self.target_url:
            errors["target_url"] = "give a deployment or a target URL"
        if errors:
            raise ValidationError(errors)


class BenchmarkSample(models.Model):
    """One measured request of a run (failed ones too, with their error)."""

    run = models.ForeignKey(BenchmarkRun, on_delete=models.CASCADE, related_name="samples")
    mode = models.CharField(max_length=8, choices=BenchmarkMode.choices)
    concurrency = models.PositiveIntegerField()
    # The offered rate of a goodput sweep's point; 0 for a run by concurrency levels.
    request_rate = models.FloatField(default=0.0)
    index = models.PositiveIntegerField()
    ok = models.BooleanField(default=True)
    error = models.TextField(blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    ttft_ms = models.FloatField(null=True, blank=True)
    tpot_ms = models.FloatField(null=True, blank=True)
    e2e_ms = models.FloatField(null=True, blank=True)
    started_at = models.FloatField(default=0.0, help_text="seconds since the run began")

    class Meta:
        ordering = ["run", "mode", "concurrency", "request_rate", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "mode", "concurrency", "request_rate", "index"],
                name="sample_unique_index",
            )
        ]

    def __str__(self) -> str:
        return f"{self.run_id}/{self.mode}/c{self.concurrency}/#{self.index}"
