"""The dashboard's scheduled-benchmark form. It converts text to values; the benchmarks app's
``schedules.schedule_problems`` judges them, and every problem shows at once beside its field
and in the summary above the form."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from controlplane.benchmarks import schedules
from controlplane.benchmarks.choices import DEFAULT_ITERATIONS, BenchmarkMode
from controlplane.benchmarks.models import Scenario
from controlplane.dashboard.forms import DEFAULT_LEVELS, AllErrorsForm, BenchmarkRunForm
from controlplane.deployments.models import Deployment

KINDS = (("crontab", "crontab (minute hour day month weekday)"), ("interval", "every N units"))


class ScheduleForm(AllErrorsForm):
    name = forms.CharField(max_length=200, required=False, help_text="e.g. nightly-hetero")
    deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.all(), to_field_name="name", required=False
    )
    scenario = forms.ModelChoiceField(
        queryset=Scenario.objects.all(), to_field_name="name", initial="short"
    )
    mode = forms.ChoiceField(choices=BenchmarkMode.choices, initial=BenchmarkMode.ALL)
    concurrency = forms.CharField(
        initial=DEFAULT_LEVELS, help_text="levels: 8, 1,2,4,8 or a range 1-8"
    )
    iterations = forms.IntegerField(
        initial=DEFAULT_ITERATIONS, help_text="requests per level and mode"
    )
    threshold_percent = forms.FloatField(
        initial=schedules.DEFAULT_THRESHOLD_PERCENT,
        label="Regression threshold (%)",
        help_text="flag the run when a figure is this much worse than the baseline run's",
    )
    kind = forms.ChoiceField(choices=KINDS, initial="crontab", label="Runs on")
    crontab = forms.CharField(
        required=False, initial="0 2 * * *", help_text="five fields; 0 2 * * * is 02:00 daily"
    )
    every = forms.IntegerField(required=False, help_text="with an interval: how many units")
    period = forms.ChoiceField(
        choices=IntervalSchedule.PERIOD_CHOICES, initial=IntervalSchedule.HOURS, required=False
    )
    enabled = forms.BooleanField(required=False, initial=True)

    @classmethod
    def for_task(cls, task: PeriodicTask, data: Any = None) -> ScheduleForm:
        """The form filled from a stored schedule (its arguments as the API stores them)."""
        try:
            kwargs = json.loads(task.kwargs or "{}")
        except ValueError:
            kwargs = {}
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        levels = kwargs.get("concurrency", DEFAULT_LEVELS)
        if isinstance(levels, list):
            levels = ",".join(str(level) for level in levels)
        initial = {
            "name": task.name,
            "deployment": kwargs.get("deployment"),
            "scenario": kwargs.get("scenario", "short"),
            "mode": kwargs.get("mode", BenchmarkMode.ALL),
            "concurrency": str(levels),
            "iterations": kwargs.get("iterations", DEFAULT_ITERATIONS),
            "threshold_percent": kwargs.get(
                "threshold_percent", schedules.DEFAULT_THRESHOLD_PERCENT
            ),
            "kind": "interval" if task.interval_id else "crontab",
            "crontab": schedules.crontab_text(task) or "0 2 * * *",
            "every": task.interval.every if task.interval else None,
            "period": task.interval.period if task.interval else IntervalSchedule.HOURS,
            "enabled": task.enabled,
        }
        return cls(data, initial=initial)

    def clean_concurrency(self) -> list[int]:
        return BenchmarkRunForm._levels(self.cleaned_data["concurrency"])

    def submitted(self) -> schedules.ScheduleForm:
        """What was submitted, for the service to judge; fields that did not convert are
        left out of the arguments (their own error already shows)."""
        data = self.cleaned_data
        kwargs: dict[str, Any] = {}
        if "deployment" in data:
            deployment = data.get("deployment")
            kwargs["deployment"] = deployment.name if deployment is not None else None
        if data.get("scenario") is not None:
            kwargs["scenario"] = data["scenario"].name
        for name in ("mode", "concurrency", "iterations", "threshold_percent"):
            if data.get(name) is not None:
                kwargs[name] = data[name]
        return schedules.ScheduleForm(
            name=data.get("name") or "",
            kwargs=kwargs,
            kind=data.get("kind") or "",
            crontab=data.get("crontab") or "",
            every=data.get("every"),
            period=data.get("period") or "",
            enabled=bool(data.get("enabled")),
        )

    def add_problems(self, problems: dict[str, str]) -> None:
        for field, message in problems.items():
            self.add_problem(field, message)
