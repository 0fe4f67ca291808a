from django.db import models

from controlplane.core.lifecycle import Lifecycle


class BenchmarkMode(models.TextChoices):
    CPU = "cpu", "CPU only"
    GPU = "gpu", "GPU only"
    HETERO = "hetero", "heterogeneous (GPU prefill, CPU decode)"
    ALL = "all", "all three in turn"


class RunStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


ACTIVE_STATUSES = (RunStatus.QUEUED, RunStatus.RUNNING)

# What a page shows for a run: its status, except that a running run whose cancel was
# requested shows "cancelling" until the runner stops it (a display state, not a stored one).
CANCELLING = "cancelling"

# The one definition of a run's defaults, for the dashboard's form, the admin's action, the
# API and scheduled runs alike: a first run that ends in about a minute on the simulated
# engines ``make up`` starts (a simulated A100 decoding a 32B model at about 12 ms a token):
# 8 + 4 + 2 + 1 rounds of about 3.2 s a request of the short scenario in hetero mode.
# 100 iterations took about 10 minutes.
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
DEFAULT_ITERATIONS = 8

_R = RunStatus
# docs/lifecycles.md#benchmark-run shows this table; test_lifecycles.py checks they agree.
# The moves are compare-and-set updates (runner.claim, runner._finish, services.request_cancel)
# whose "from" states come from here.
RUN_LIFECYCLE = Lifecycle(
    "status",
    {
        _R.QUEUED: {_R.RUNNING, _R.CANCELLED},
        _R.RUNNING: {_R.SUCCEEDED, _R.FAILED, _R.CANCELLED},
        _R.SUCCEEDED: set(),
        _R.FAILED: set(),
        _R.CANCELLED: set(),
    },
)


# The Celery task name of a run (tasks.py registers it; services queue it through core.dispatch).
EXECUTE_RUN_TASK = "benchmarks.execute_run"


class BenchmarkAuditAction(models.TextChoices):
    """The audit rows' actions (``AuditEntry.action``) on benchmark runs, scenarios and
    schedules."""

    RUN_CREATED = "benchmark.created"
    RUN_CANCEL = "benchmark.cancel"
    RUN_DELETED = "benchmark.deleted"
    SCENARIO_DELETED = "scenario.deleted"
    SCHEDULE_SAVED = "benchmark.schedule.saved"
