"""Scheduled benchmarks are django-celery-beat PeriodicTask rows running
``benchmarks.scheduled_run`` with keyword arguments; this module validates those arguments.

A broken entry (unknown deployment or scenario, bad numbers) disables its PeriodicTask with
the reason in its description; it never crashes beat or the worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from common.errors import FieldError
from controlplane.benchmarks.choices import BenchmarkMode
from controlplane.benchmarks.models import MAX_CONCURRENCY, Scenario
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


def parse_kwargs(kwargs: dict[str, Any]) -> ScheduledBenchmark:
    known = {"deployment", "scenario", "mode", "concurrency", "iterations", "threshold_percent"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ScheduleError(unknown[0], f"unknown argument; known: {', '.join(sorted(known))}")
    try:
        deployment = Deployment.objects.get(name=kwargs.get("deployment"))
    except Deployment.DoesNotExist:
        raise ScheduleError(
            "deployment", f"no deployment named {kwargs.get('deployment')!r}"
        ) from None
    try:
        scenario = Scenario.objects.get(name=kwargs.get("scenario", "short"))
    except Scenario.DoesNotExist:
        raise ScheduleError("scenario", f"unknown scenario {kwargs.get('scenario')!r}") from None
    mode = kwargs.get("mode", BenchmarkMode.ALL)
    if mode not in BenchmarkMode.values:
        raise ScheduleError(
            "mode", f"must be one of {', '.join(BenchmarkMode.values)}; got {mode!r}"
        )
    concurrency = kwargs.get("concurrency", [scenario.concurrency_max])
    if isinstance(concurrency, int):
        concurrency = [concurrency]
    if (
        not isinstance(concurrency, list)
        or not concurrency
        or not all(isinstance(c, int) and 1 <= c <= MAX_CONCURRENCY for c in concurrency)
    ):
        raise ScheduleError("concurrency", f"must be integers between 1 and {MAX_CONCURRENCY}")
    iterations = kwargs.get("iterations", 100)
    if not isinstance(iterations, int) or not 1 <= iterations <= 100000:
        raise ScheduleError("iterations", "must be an integer between 1 and 100000")
    threshold = kwargs.get("threshold_percent", DEFAULT_THRESHOLD_PERCENT)
    if not isinstance(threshold, int | float) or not 0 <= threshold <= 1000:
        raise ScheduleError("threshold_percent", "must be a number between 0 and 1000")
    return ScheduledBenchmark(deployment, scenario, mode, concurrency, iterations, float(threshold))


def create_schedule(
    name: str,
    *,
    deployment: Deployment,
    scenario: str = "short",
    mode: str = BenchmarkMode.ALL,
    concurrency: list[int] | None = None,
    iterations: int = 100,
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
]
