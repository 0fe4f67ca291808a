"""Scheduled benchmarks are django-celery-beat PeriodicTask rows running
``benchmarks.scheduled_run`` with keyword arguments; this module validates those arguments.

A broken entry (unknown deployment or scenario, bad numbers) disables its PeriodicTask with
the reason in its description; it never crashes beat or the worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask
from django_celery_beat.validators import (
    day_of_month_validator,
    day_of_week_validator,
    hour_validator,
    minute_validator,
    month_of_year_validator,
)

from common.errors import FieldError
from controlplane.benchmarks.choices import (
    DEFAULT_CONCURRENCY,
    DEFAULT_ITERATIONS,
    BenchmarkAuditAction,
    BenchmarkMode,
)
from controlplane.benchmarks.models import MAX_CONCURRENCY, Scenario
from controlplane.core import audit
from controlplane.core.actors import Actor
from controlplane.deployments.models import Deployment

TASK_NAME = "benchmarks.scheduled_run"
DEFAULT_THRESHOLD_PERCENT = 10.0


class ScheduleError(FieldError):
    """A scheduled benchmark's arguments are wrong."""


@dataclass(frozen=True)
class ScheduledBenchmark:
    deployment: Deployment
    scenario: Scenario
    mode: str
    concurrency: list[int]
    iterations: int
    threshold_percent: float


KNOWN_ARGUMENTS = (
    "deployment",
    "scenario",
    "mode",
    "concurrency",
    "iterations",
    "threshold_percent",
)


def kwargs_problems(kwargs: dict[str, Any]) -> tuple[dict[str, str], ScheduledBenchmark | None]:
    """Every problem of a schedule's keyword arguments, one per argument (all found at once),
    and the benchmark they describe when there is none."""
    problems: dict[str, str] = {}
    for name in sorted(set(kwargs) - set(KNOWN_ARGUMENTS)):
        problems[name] = f"unknown argument; known: {', '.join(sorted(KNOWN_ARGUMENTS))}"
    deployment = Deployment.objects.filter(name=kwargs.get("deployment")).first()
    if kwargs.get("deployment") is None:
        problems["deployment"] = "choose the deployment to benchmark"
    elif deployment is None:
        problems["deployment"] = f"no deployment named {kwargs.get('deployment')!r}"
    scenario = Scenario.objects.filter(name=kwargs.get("scenario", "short")).first()
    if scenario is None:
        problems["scenario"] = f"unknown scenario {kwargs.get('scenario')!r}"
    mode = kwargs.get("mode", BenchmarkMode.ALL)
    if mode not in BenchmarkMode.values:
        problems["mode"] = f"must be one of {', '.join(BenchmarkMode.values)}; got {mode!r}"
    concurrency = kwargs.get("concurrency", list(DEFAULT_CONCURRENCY))
    if isinstance(concurrency, int) and not isinstance(concurrency, bool):
        concurrency = [concurrency]
    if (
        not isinstance(concurrency, list)
        or not concurrency
        or not all(
            isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_CONCURRENCY
            for c in concurrency
        )
    ):
        problems["concurrency"] = f"must be integers between 1 and {MAX_CONCURRENCY}"
    iterations = kwargs.get("iterations", DEFAULT_ITERATIONS)
    if (
        isinstance(iterations, bool)
        or not isinstance(iterations, int)
        or not 1 <= iterations <= 100000
    ):
        problems["iterations"] = "must be an integer between 1 and 100000"
    threshold = kwargs.get("threshold_percent", DEFAULT_THRESHOLD_PERCENT)
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not 0 <= threshold <= 1000
    ):
        problems["threshold_percent"] = "must be a number between 0 and 1000"
    if problems or deployment is None or scenario is None:
        return problems, None
    return problems, ScheduledBenchmark(
        deployment, scenario, mode, concurrency, iterations, float(threshold)
    )


def parse_kwargs(kwargs: dict[str, Any]) -> ScheduledBenchmark:
    """The benchmark a schedule's keyword arguments describe; the first problem raises."""
    problems, spec = kwargs_problems(kwargs)
    if problems or spec is None:
        name, message = next(iter(problems.items()))
        raise ScheduleError(name, message)
    return spec


def create_schedule(
    name: str,
    *,
    deployment: Deployment,
    scenario: str = "short",
    mode: str = BenchmarkMode.ALL,
    concurrency: list[int] | None = None,
    iterations: int = DEFAULT_ITERATIONS,
    threshold_percent: float = DEFAULT_THRESHOLD_PERCENT,
    crontab: str = "0 2 * * *",
) -> PeriodicTask:
    """A nightly (by default) benchmark of a deployment; validated before it is saved."""
    kwargs: dict[str, Any] = {
        "deployment": deployment.name,
        "scenario": scenario,
        "mode": mode,
        "iterations": iterations,
        "threshold_percent": threshold_percent,
    }
    if concurrency:
        kwargs["concurrency"] = concurrency
    parse_kwargs(kwargs)
    minute, hour, day_of_month, month_of_year, day_of_week = crontab.split()
    schedule, _ = CrontabSchedule.objects.get_or_create(
        minute=minute,
        hour=hour,
        day_of_month=day_of_month,
        month_of_year=month_of_year,
        day_of_week=day_of_week,
    )
    return PeriodicTask.objects.create(
        name=name, task=TASK_NAME, crontab=schedule, kwargs=json.dumps(kwargs)
    )


PERIODS = tuple(period for period, _ in IntervalSchedule.PERIOD_CHOICES)
CRON_FIELDS = (
    ("minute", minute_validator),
    ("hour", hour_validator),
    ("day_of_month", day_of_month_validator),
    ("month_of_year", month_of_year_validator),
    ("day_of_week", day_of_week_validator),
)


@dataclass(frozen=True)
class ScheduleForm:
    """What the dashboard's schedule form submits: the benchmark's arguments and when it
    runs, as a crontab line or an interval."""

    name: str
    kwargs: dict[str, Any]
    kind: str  # "crontab" or "interval"
    crontab: str = ""
    every: int | None = None
    period: str = IntervalSchedule.HOURS
    enabled: bool = True


def schedule_problems(form: ScheduleForm, task: PeriodicTask | None = None) -> dict[str, str]:
    """Every reason :func:`save_schedule` would refuse ``form``, found at once, by field:
    the name, each benchmark argument, and the crontab or interval."""
    problems: dict[str, str] = {}
    name = form.name.strip()
    if not name:
        problems["name"] = "give the schedule a name"
    else:
        taken = PeriodicTask.objects.filter(name=name)
        if task is not None:
            taken = taken.exclude(pk=task.pk)
        if taken.exists():
            problems["name"] = f"a periodic task named {name!r} exists already"
    problems.update(kwargs_problems(form.kwargs)[0])
    if form.kind == "crontab":
        parts = form.crontab.split()
        if len(parts) != 5:
            problems["crontab"] = (
                "give five fields: minute hour day-of-month month day-of-week, "
                f"e.g. 0 2 * * *; got {len(parts)}"
            )
        else:
            bad = []
            for (label, validator), value in zip(CRON_FIELDS, parts, strict=True):
                try:
                    validator(value)
                except (ValidationError, ValueError) as exc:
                    bad.append(f"{label.replace('_', ' ')} {value!r}: {_first(exc)}")
            if bad:
                problems["crontab"] = "; ".join(bad)
    elif form.kind == "interval":
        if form.every is None or form.every < 1:
            problems["every"] = "must be a whole number of at least 1"
        if form.period not in PERIODS:
            problems["period"] = f"must be one of {', '.join(PERIODS)}"
    else:
        problems["kind"] = "choose a crontab or an interval"
    return problems


def _first(exc: Exception) -> str:
    messages = getattr(exc, "messages", None)
    return str(messages[0]) if messages else str(exc)


def save_schedule(
    form: ScheduleForm, *, task: PeriodicTask | None = None, acting_user: Actor
) -> PeriodicTask:
    """Create (or change) a scheduled benchmark, after checking every field at once; an
    audit row names who did it. A disabled one keeps its rows and runs no more."""
    problems = schedule_problems(form, task)
    if problems:
        raise ValidationError({field: [message] for field, message in problems.items()})
    with transaction.atomic():
        task = task or PeriodicTask(task=TASK_NAME)
        task.name = form.name.strip()
        task.task = TASK_NAME
        task.kwargs = json.dumps(form.kwargs)
        task.enabled = form.enabled
        if form.enabled and task.description.startswith("disabled: "):
            task.description = ""  # the reason a broken entry was disabled no longer holds
        if form.kind == "crontab":
            minute, hour, day_of_month, month_of_year, day_of_week = form.crontab.split()
            task.crontab, _ = CrontabSchedule.objects.get_or_create(
                minute=minute,
                hour=hour,
                day_of_month=day_of_month,
                month_of_year=month_of_year,
                day_of_week=day_of_week,
            )
            task.interval = None
        else:
            task.interval, _ = IntervalSchedule.objects.get_or_create(
                every=form.every, period=form.period
            )
            task.crontab = None
        task.save()
        audit.record(
            BenchmarkAuditAction.SCHEDULE_SAVED,
            task,
            acting_user=acting_user,
            detail={"kwargs": form.kwargs, "enabled": form.enabled},
        )
    return task


def crontab_text(task: PeriodicTask) -> str:
    """A task's crontab as the five fields the form takes; "" without one."""
    cron = task.crontab
    if cron is None:
        return ""
    return " ".join(
        [cron.minute, cron.hour, cron.day_of_month, cron.month_of_year, cron.day_of_week]
    )


def disable(schedule_name: str | None, reason: str) -> None:
    if not schedule_name:
        return
    PeriodicTask.objects.filter(name=schedule_name).update(
        enabled=False, description=f"disabled: {reason}"
    )


__all__ = [
    "CrontabSchedule",
    "IntervalSchedule",
    "ScheduleError",
    "create_schedule",
    "parse_kwargs",
    "save_schedule",
    "schedule_problems",
]
