"""The Batch API's fixed vocabularies: OpenAI's batch statuses and file purposes, the line
states, the endpoints a batch may call, and the task names (docs/batches.md)."""

from django.db import models

from controlplane.core.lifecycle import Lifecycle


class BatchStatus(models.TextChoices):
    VALIDATING = "validating", "validating"
    FAILED = "failed", "failed"
    IN_PROGRESS = "in_progress", "in progress"
    FINALIZING = "finalizing", "finalizing"
    COMPLETED = "completed", "completed"
    EXPIRED = "expired", "expired"
    CANCELLING = "cancelling", "cancelling"
    CANCELLED = "cancelled", "cancelled"


_B = BatchStatus
# docs/batches.md shows this table. The moves are compare-and-set updates whose "from" states
# come from here (services.move).
BATCH_LIFECYCLE = Lifecycle(
    "status",
    {
        _B.VALIDATING: {_B.IN_PROGRESS, _B.FAILED, _B.CANCELLING, _B.EXPIRED},
        _B.IN_PROGRESS: {_B.FINALIZING, _B.CANCELLING, _B.EXPIRED},
        _B.FINALIZING: {_B.COMPLETED},
        _B.CANCELLING: {_B.CANCELLED},
        _B.FAILED: set(),
        _B.COMPLETED: set(),
        _B.EXPIRED: set(),
        _B.CANCELLED: set(),
    },
)
# A worker owns these: the sweep re-queues one whose worker went silent.
WORKER_OWNED_STATUSES = (_B.VALIDATING, _B.IN_PROGRESS, _B.CANCELLING)
# Every status but a final one: the batch's counts may still change (its page refreshes itself).
UNFINISHED_STATUSES = (_B.VALIDATING, _B.IN_PROGRESS, _B.FINALIZING, _B.CANCELLING)
FINAL_STATUSES = (_B.FAILED, _B.COMPLETED, _B.EXPIRED, _B.CANCELLED)


class LineStatus(models.TextChoices):
    PENDING = "pending", "pending"
    DONE = "done", "done"
    FAILED = "failed", "failed"


class FilePurpose(models.TextChoices):
    BATCH = "batch", "batch input"
    BATCH_OUTPUT = "batch_output", "batch output"


# The endpoints a batch may call, as OpenAI names them (the router serves both).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = ("24h",)

# Celery task names (tasks.py registers them; services queue them through core.dispatch).
RUN_BATCH_TASK = "batches.run_batch"
SWEEP_TASK = "batches.sweep"


class BatchAuditAction(models.TextChoices):
    """The audit rows' actions on batches (``AuditEntry.action``)."""

    BATCH_CREATED = "batch.created"
    BATCH_CANCELLED = "batch.cancelled"
