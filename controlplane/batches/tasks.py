from __future__ import annotations

from celery import shared_task

from controlplane.batches import runner, services
from controlplane.batches.choices import RUN_BATCH_TASK, SWEEP_TASK
from controlplane.core import tracing


@shared_task(name=RUN_BATCH_TASK, ignore_result=True, acks_late=True)
def run_batch(batch_id: str) -> str:
    tracing.annotate(batch=batch_id)  # the task's span; its lines' requests are its children
    return runner.execute(batch_id)


@shared_task(name=SWEEP_TASK, ignore_result=True)
def sweep() -> int:
    """Beat's: queue again every active batch whose worker went silent (its lease ran out)."""
    return len(services.requeue_stranded())
