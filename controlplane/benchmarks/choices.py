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
