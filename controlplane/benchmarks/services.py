from __future__ import annotations

from typing import Any

from django.db import transaction

from controlplane.benchmarks.choices import ACTIVE_STATUSES, RunStatus
from controlplane.benchmarks.models import BenchmarkRun
from controlplane.core import audit


def create_run(*, acting_user: Any, **fields: Any) -> BenchmarkRun:
    """Create a run and queue it once the row is committed."""
    with transaction.atomic():
        run = BenchmarkRun(**fields)
        if getattr(acting_user, "_meta", None) is not None:
            run.created_by = acting_user
        run.full_clean()
        run.save()
        audit.record("benchmark.created", run, acting_user=acting_user)
        queue_run(run)
    return run


def queue_run(run: BenchmarkRun) -> None:
    from controlplane.benchmarks import tasks

    run_id = run.pk
    transaction.on_commit(lambda: tasks.execute_run.delay(run_id))


def request_cancel(run: BenchmarkRun, *, acting_user: Any) -> BenchmarkRun:
    """Queued runs cancel at once; a running one stops at its next progress check."""
    with transaction.atomic():
        locked = BenchmarkRun.objects.select_for_update().get(pk=run.pk)
        if locked.status not in ACTIVE_STATUSES:
            return locked
        locked.cancel_requested = True
        if locked.status == RunStatus.QUEUED:
            locked.status = RunStatus.CANCELLED
        locked.save(update_fields=["cancel_requested", "status"])
        audit.record("benchmark.cancel", locked, acting_user=acting_user)
    return locked
