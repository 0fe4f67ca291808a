from __future__ import annotations

from celery import shared_task

from controlplane.benchmarks import runner


@shared_task(name="benchmarks.execute_run", ignore_result=True, acks_late=True)
def execute_run(run_id: int) -> str:
    return runner.execute(run_id)
