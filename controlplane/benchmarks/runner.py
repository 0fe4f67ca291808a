"""Executes a BenchmarkRun with the load generator (filled in with the load generator)."""

from __future__ import annotations

from django.utils import timezone

from controlplane.benchmarks.choices import RunStatus
from controlplane.benchmarks.models import BenchmarkRun


def claim(run_id: int) -> bool:
    """Compare-and-set queued -> running; a redelivered task finds it taken and stops."""
    return bool(
        BenchmarkRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
            status=RunStatus.RUNNING, started_at=timezone.now()
        )
    )


def execute(run_id: int) -> str:
    if not claim(run_id):
        return BenchmarkRun.objects.get(pk=run_id).status
    run = BenchmarkRun.objects.get(pk=run_id)
    run.status = RunStatus.FAILED
    run.error = "the load generator is not wired to the control plane yet"
    run.finished_at = timezone.now()
    run.save(update_fields=["status", "error", "finished_at"])
    return run.status
