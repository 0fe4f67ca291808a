from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from django_celery_beat.models import PeriodicTask

from controlplane.benchmarks import runner, schedules, services
from controlplane.benchmarks.choices import EXECUTE_RUN_TASK
from controlplane.core import tracing

log = logging.getLogger(__name__)


@shared_task(name=EXECUTE_RUN_TASK, ignore_result=True, acks_late=True)
def execute_run(run_id: int) -> str:
    tracing.annotate(benchmark_run=run_id)  # the task's span (docs/tracing.md)
    return runner.execute(run_id)


@shared_task(name=schedules.TASK_NAME, bind=True, ignore_result=True)
def scheduled_run(self: Any, **kwargs: Any) -> int | None:
    """Beat's entry point: create a run from the schedule's arguments and execute it here."""
    # django-celery-beat sends the schedule's name as a message header.
    schedule_name = getattr(self.request, "periodic_task_name", None) or (
        self.request.headers or {}
    ).get("periodic_task_name")
    try:
        spec = schedules.parse_kwargs(kwargs)
    except schedules.ScheduleError as exc:
        log.error("scheduled benchmark %s disabled: %s", schedule_name, exc)
        schedules.disable(schedule_name, str(exc))
        return None
    schedule = PeriodicTask.objects.filter(name=schedule_name).first() if schedule_name else None
    run = services.create_run(
        acting_user=f"schedule:{schedule_name or 'unnamed'}",
        name=f"{schedule_name or 'scheduled'}: {spec.scenario.name}",
        scenario=spec.scenario,
        deployment=spec.deployment,
        mode=spec.mode,
        concurrency=spec.concurrency,
        iterations=spec.iterations,
        schedule=schedule,
        regression_threshold_percent=spec.threshold_percent,
    )
    return run.pk
