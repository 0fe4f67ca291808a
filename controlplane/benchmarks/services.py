from __future__ import annotations

from typing import Any

from django.db import transaction

from controlplane.benchmarks.choices import ACTIVE_STATUSES, RunStatus
from controlplane.benchmarks.models import BenchmarkRun
from controlplane.core import audit

ADVISOR_RUNS = 20  # the mode advisor's window: the newest successful runs


def create_run(*, acting_user: Any, **fields: Any) -> BenchmarkRun:
    """Create a run and queue it once the row is committed."""
    with transaction.atomic():
        run = BenchmarkRun(**fields)
        user, _ = audit.split_actor(acting_user)
        if user is not None:
            run.created_by = user
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


def baseline_for(run: BenchmarkRun) -> BenchmarkRun | None:
    """The deployment's baseline run of the same scenario (the newest marked baseline)."""
    if run.deployment_id is None:
        return None
    return (
        BenchmarkRun.objects.filter(
            deployment_id=run.deployment_id,
            scenario_id=run.scenario_id,
            is_baseline=True,
            status=RunStatus.SUCCEEDED,
        )
        .exclude(pk=run.pk)
        .order_by("-finished_at")
        .first()
    )


def flag_regression(run: BenchmarkRun, threshold_percent: float) -> bool:
    """Compare a finished run with its baseline and record the verdict on the run."""
    from controlplane.benchmarks.analysis import compare_to_baseline

    baseline = baseline_for(run)
    if baseline is None:
        run.regression = False
        run.regression_detail = {"baseline": None, "note": "no baseline run to compare with"}
    else:
        changes = compare_to_baseline(run.summary, baseline.summary, threshold_percent)
        run.regression = bool(changes)
        run.regression_detail = {
            "baseline": baseline.pk,
            "threshold_percent": threshold_percent,
            "changes": [change.__dict__ for change in changes],
        }
    run.save(update_fields=["regression", "regression_detail"])
    return run.regression


def advisor_summaries(
    deployment_id: int | None = None, limit: int = ADVISOR_RUNS
) -> list[dict[str, Any]]:
    """The summaries the mode advisor decides from: the newest ``limit`` successful runs
    (of one deployment if given), oldest first."""
    runs = BenchmarkRun.objects.filter(status=RunStatus.SUCCEEDED).order_by("-finished_at")
    if deployment_id is not None:
        runs = runs.filter(deployment_id=deployment_id)
    return [run.summary for run in reversed(list(runs[:limit]))]
