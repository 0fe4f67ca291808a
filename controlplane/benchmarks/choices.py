from django.db import models


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


# The Celery task name of a run (tasks.py registers it; services queue it through core.dispatch).
EXECUTE_RUN_TASK = "benchmarks.execute_run"
