"""The Batch API's operations on rows: files, batches, their validation, each line's result
and the output and error files (docs/batches.md). The worker's loop is ``runner.py``.

Every status move is a compare-and-set from the states ``BATCH_LIFECYCLE`` allows, so a
redelivered task, a sweep and a cancel that race each make their move once or not at all.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from controlplane.batches.auth import Caller, allows_model
from controlplane.batches.choices import (
    BATCH_LIFECYCLE,
    COMPLETION_WINDOWS,
    ENDPOINTS,
    RUN_BATCH_TASK,
    WORKER_OWNED_STATUSES,
    BatchAuditAction,
    BatchStatus,
    FilePurpose,
    LineStatus,
)
from controlplane.batches.models import Batch, BatchFile, BatchLine
from controlplane.batches.shapes import BatchApiError, not_found
from controlplane.batches.validation import TooManyLines, parse_input, split_lines
from controlplane.core import audit
from controlplane.core.dispatch import enqueue
from controlplane.tenants.models import Tenant

log = logging.getLogger("controlplane.batches")

# OpenAI's limits on a batch's metadata.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# A failed batch's ``errors`` names this many lines; its error file names them all.
MAX_LISTED_ERRORS = 100
# The lease a queued task's batch holds until a worker takes it (``claim``).
QUEUED = "queued"
# The lease the sweep holds while it ends a batch past its window.
SWEEPER = "sweep"
COMPLETION_WINDOW = timedelta(hours=24)


def _actor(caller: Caller) -> str:
    return f"tenant:{caller.owner}"


# -- files --------------------------------------------------------------------------------


def create_file(
    caller: Caller, *, filename: str, purpose: str, size: int, pieces: Iterable[bytes]
) -> BatchFile:
    """Store an upload of ``size`` bytes that arrives in ``pieces``, a chunk at a time, within
    the caller's quota (``check_quota``)."""
    if purpose != FilePurpose.BATCH:
        raise BatchApiError(
            400,
            f"purpose must be 'batch' (the only purpose this server stores); got {purpose!r}",
            code="invalid_purpose",
            param="purpose",
        )
    check_file_size(size)
    with transaction.atomic(durable=True):
        check_quota(caller, size)
        created = BatchFile.objects.create(
            tenant=caller.tenant,
            owner=caller.owner,
            purpose=purpose,
            filename=filename[:255] or "upload.jsonl",
            bytes=size,
        )
        written = created.write(pieces)
        if written != size:  # the upload said one size and held another
            check_file_size(written)
            created.bytes = written
            created.save(update_fields=["bytes"])
    return created


def check_file_size(size: int) -> None:
    limit = settings.BATCH_MAX_FILE_BYTES
    if size > limit:
        raise BatchApiError(
            413,
            f"the file is {size} bytes; the limit is {limit} bytes (BATCH_MAX_FILE_BYTES)",
            code="file_too_large",
            param="file",
        )


def check_quota(caller: Caller, size: int) -> None:
    """Refuse a new file of ``size`` bytes that would take the caller over the files or bytes
    it may store (``BATCH_MAX_FILES_PER_OWNER``, ``BATCH_MAX_BYTES_PER_OWNER``). Run in the
    transaction that stores the file: the tenant's row stays locked until it commits, so two
    uploads of one tenant cannot both pass on the same count. Batches' output and error
    files are never refused (``_write_file``) but count here."""
    if caller.tenant is not None:
        Tenant.objects.select_for_update().filter(pk=caller.tenant.pk).exists()
    stored = BatchFile.objects.owned_by(caller.owner).aggregate(
        files=Count("pk"), bytes=Sum("bytes")
    )
    files, used = stored["files"], stored["bytes"] or 0
    max_files = settings.BATCH_MAX_FILES_PER_OWNER
    max_bytes = settings.BATCH_MAX_BYTES_PER_OWNER
    if files + 1 > max_files:
        raise BatchApiError(
            403,
            f"{caller.owner!r} stores {files} files; the limit is {max_files} files "
            "(BATCH_MAX_FILES_PER_OWNER): delete files it no longer needs",
            code="storage_quota_exceeded",
            param="file",
        )
    if used + size > max_bytes:
        raise BatchApiError(
            403,
            f"{caller.owner!r} stores {used} bytes and this file has {size}; the limit is "
            f"{max_bytes} bytes (BATCH_MAX_BYTES_PER_OWNER): delete files it no longer needs",
            code="storage_quota_exceeded",
            param="file",
        )


def owned_file(caller: Caller, file_id: str) -> BatchFile:
    found = BatchFile.objects.owned_by(caller.owner).filter(pk=file_id).first()
    if found is None:
        raise not_found("file", file_id)
    assert isinstance(found, BatchFile)
    return found


def delete_file(caller: Caller, file_id: str) -> None:
    deleted, _ = BatchFile.objects.owned_by(caller.owner).filter(pk=file_id).delete()
    if not deleted:
        raise not_found("file", file_id)


# -- batches ------------------------------------------------------------------------------


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BatchApiError(
            400, "metadata must be an object", code="invalid_metadata", param="metadata"
        )
    if len(metadata) > MAX_METADATA_KEYS:
        raise BatchApiError(
            400,
            f"metadata has {len(metadata)} keys; the limit is {MAX_METADATA_KEYS}",
            code="invalid_metadata",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise BatchApiError(
                400,
                f"metadata key {key[:20]!r}... is over {MAX_METADATA_KEY} characters",
                code="invalid_metadata",
                param="metadata",
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise BatchApiError(
                400,
                f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE} characters",
                code="invalid_metadata",
                param=f"metadata.{key}",
            )
    return metadata


def create_batch(
    caller: Caller,
    *,
    input_file_id: Any,
    endpoint: Any,
    completion_window: Any,
    metadata: Any = None,
) -> Batch:
    """A batch in ``validating``; the worker checks its lines and runs them."""
    if endpoint not in ENDPOINTS:
        raise BatchApiError(
            400,
            f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}",
            code="invalid_endpoint",
            param="endpoint",
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchApiError(
            400,
            f"completion_window must be '24h'; got {completion_window!r}",
            code="invalid_completion_window",
            param="completion_window",
        )
    checked = check_metadata(metadata)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise BatchApiError(
            400, "input_file_id must be a file's id", code="invalid_file", param="input_file_id"
        )
    source = owned_file(caller, input_file_id)
    if source.purpose != FilePurpose.BATCH:
        raise BatchApiError(
            400,
            f"file {input_file_id!r} has purpose {source.purpose!r}; a batch reads a 'batch' file",
            code="invalid_file",
            param="input_file_id",
        )
    now = timezone.now()
    with transaction.atomic(durable=True):
        batch = Batch.objects.create(
            tenant=caller.tenant,
            owner=caller.owner,
            endpoint=endpoint,
            completion_window=completion_window,
            input_file=source,
            input_file_ref=source.id,
            metadata=checked,
            created_at=now,
            expires_at=now + COMPLETION_WINDOW,
            lease_owner=QUEUED,
            lease_until=now + timedelta(seconds=settings.BATCH_QUEUED_SECONDS),
        )
        audit.record(
            BatchAuditAction.BATCH_CREATED,
            batch,
            acting_user=_actor(caller),
            detail={"endpoint": endpoint},
        )
        enqueue(RUN_BATCH_TASK, batch.id)
    return batch


def owned_batch(caller: Caller, batch_id: str) -> Batch:
    found = Batch.objects.owned_by(caller.owner).filter(pk=batch_id).first()
    if found is None:
        raise not_found("batch", batch_id)
    assert isinstance(found, Batch)
    return found


def move(batch_id: str, to: str, **fields: Any) -> bool:
    """Compare-and-set the batch's status to ``to`` from any state the table allows."""
    sources = BATCH_LIFECYCLE.sources(to)
    return bool(Batch.objects.filter(pk=batch_id, status__in=sources).update(status=to, **fields))


def cancel_batch(caller: Caller, batch_id: str) -> Batch:
    """Stop taking lines: ``cancelling`` now, ``cancelled`` once the lines under way finish
    (the worker writes the output and error files of what finished)."""
    batch = owned_batch(caller, batch_id)
    if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return batch
    with transaction.atomic(durable=True):
        if not move(batch.id, BatchStatus.CANCELLING, cancelling_at=timezone.now()):
            batch.refresh_from_db()
            raise BatchApiError(
                409,
                f"a batch that is {batch.status} cannot be cancelled",
                code="batch_not_cancellable",
                param="batch_id",
            )
        audit.record(BatchAuditAction.BATCH_CANCELLED, batch, acting_user=_actor(caller))
        # A worker running it stops by itself; one with no worker is finished by this task.
        enqueue(RUN_BATCH_TASK, batch.id)
    batch.refresh_from_db()
    return batch


def page(rows: Any, *, after: str | None, limit: Any, kind: str) -> tuple[list[Any], bool]:
    """A page of ``rows`` (newest first) after the row whose id is ``after``."""
    try:
        count = int(limit) if limit not in (None, "") else 20
    except (TypeError, ValueError):
        raise BatchApiError(
            400, "limit must be an integer", code="invalid_limit", param="limit"
        ) from None
    if not 1 <= count <= 100:
        raise BatchApiError(
            400, "limit must be between 1 and 100", code="invalid_limit", param="limit"
        )
    if after:
        anchor = rows.filter(pk=after).values_list("created_at", flat=True).first()
        if anchor is None:
            raise not_found(kind, after)
        rows = rows.filter(Q(created_at__lt=anchor) | Q(created_at=anchor, pk__gt=after))
    found = list(rows.order_by("-created_at", "pk")[: count + 1])
    return found[:count], len(found) > count


# -- the worker's side --------------------------------------------------------------------


def claim(batch_id: str, owner: str) -> bool:
    """Take the batch's lease for ``owner``: free, run out, or held by a queued task."""
    now = timezone.now()
    free = Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_owner=QUEUED)
    return bool(
        Batch.objects.filter(free, pk=batch_id).update(
            lease_owner=owner, lease_until=now + timedelta(seconds=settings.BATCH_LEASE_SECONDS)
        )
    )


def renew(batch_id: str, owner: str) -> bool:
    until = timezone.now() + timedelta(seconds=settings.BATCH_LEASE_SECONDS)
    return bool(Batch.objects.filter(pk=batch_id, lease_owner=owner).update(lease_until=until))


def release(batch_id: str, owner: str) -> None:
    Batch.objects.filter(pk=batch_id, lease_owner=owner).update(lease_owner="", lease_until=None)


def validate(batch_id: str) -> None:
    """Copy the input file's lines into rows: the good ones pending, each bad one failed with
    its reason. ``validating`` becomes ``in_progress``, or ``failed`` when no line is good,
    the file has more lines than ``BATCH_MAX_LINES``, or checking it failed unexpectedly (so
    no file leaves its batch ``validating`` to be read again by every sweep). A batch past
    its window is left to ``finish``, which expires it, unread."""
    try:
        _validate(batch_id)
    except Exception as exc:
        log.exception("validating batch %s failed", batch_id)
        message = (
            f"the input file could not be validated ({type(exc).__name__}); "
            "the control plane logged why"
        )
        with transaction.atomic(durable=True):
            batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
            if batch is not None and batch.status == BatchStatus.VALIDATING:
                _fail(batch, [_file_error("validation_error", message)])


def _validate(batch_id: str) -> None:
    with transaction.atomic(durable=True):
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        if batch.status != BatchStatus.VALIDATING or batch.expires_at <= timezone.now():
            return
        source = BatchFile.objects.filter(pk=batch.input_file_id).first()
        if source is None:
            _fail(batch, [_file_error("input_file_deleted", "the input file was deleted")])
            return
        try:
            parsed = parse_input(
                split_lines(source.iter_bytes()),
                endpoint=batch.endpoint,
                allows_model=lambda model: allows_model(batch.tenant, model),
                max_lines=settings.BATCH_MAX_LINES,
            )
        except TooManyLines as exc:
            _fail(batch, [_file_error("too_many_requests", f"{exc} (BATCH_MAX_LINES)")])
            return
        if not parsed:
            _fail(batch, [_file_error("empty_file", "the input file has no requests")])
            return
        now = timezone.now()
        BatchLine.objects.bulk_create(
            (
                BatchLine(
                    batch=batch,
                    line_no=p.line_no,
                    custom_id=p.custom_id,
                    body=p.body,
                    status=LineStatus.FAILED if p.error else LineStatus.PENDING,
                    error=p.error.as_dict() if p.error else None,
                    finished_at=now if p.error else None,
                )
                for p in parsed
            ),
            batch_size=1000,
        )
        bad = [p.error.as_dict() for p in parsed if p.error]
        batch.total = len(parsed)
        batch.failed = len(bad)
        batch.save(update_fields=["total", "failed"])
        if len(bad) == len(parsed):
            _fail(batch, bad[:MAX_LISTED_ERRORS], with_error_file=True)
            return
        move(batch.id, BatchStatus.IN_PROGRESS, in_progress_at=now)


def _file_error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": "input_file_id", "line": None}


def _fail(batch: Batch, errors: list[dict[str, Any]], *, with_error_file: bool = False) -> None:
    error_file = _write_file(batch, "errors", _error_lines(batch)) if with_error_file else None
    now = timezone.now()
    move(batch.id, BatchStatus.FAILED, failed_at=now, errors=errors, error_file=error_file)


def pending_lines(batch_id: str, chunk: int = 200) -> Iterator[BatchLine]:
    """The batch's pending lines in file order, read a chunk at a time (each chunk anew: a
    line another worker finished meanwhile is not sent twice by this one)."""
    after = 0
    while True:
        lines = list(
            BatchLine.objects.filter(
                batch_id=batch_id, status=LineStatus.PENDING, line_no__gt=after
            ).order_by("line_no")[:chunk]
        )
        if not lines:
            return
        yield from lines
        after = lines[-1].line_no


def record_result(
    line: BatchLine,
    *,
    ok: bool,
    response: dict[str, Any] | None,
    error: dict[str, Any] | None,
) -> bool:
    """Store one line's result and count it, in a transaction of its own; False when the line
    was no longer pending (nothing is counted twice)."""
    status = LineStatus.DONE if ok else LineStatus.FAILED
    with transaction.atomic(durable=True):
        changed = BatchLine.objects.filter(pk=line.pk, status=LineStatus.PENDING).update(
            status=status, response=response, error=error, finished_at=timezone.now()
        )
        if changed:
            counter = "completed" if ok else "failed"
            Batch.objects.filter(pk=line.batch_id).update(**{counter: F(counter) + 1})
    return bool(changed)


def finish(batch_id: str) -> str:
    """Write the output and error files of a batch whose worker is done with it and move it
    to its last state: ``completed`` once no line is pending, ``cancelled`` after a cancel,
    ``expired`` past its window (its unfinished lines fail as ``batch_expired``). Returns the
    status it ends in."""
    with transaction.atomic(durable=True):
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        now = timezone.now()
        if batch.status == BatchStatus.CANCELLING:
            _finalize(batch, BatchStatus.CANCELLED, cancelled_at=now)
        elif batch.status in (BatchStatus.IN_PROGRESS, BatchStatus.VALIDATING) and (
            batch.expires_at <= now
        ):
            _expire_unfinished(batch, now)
            _finalize(batch, BatchStatus.EXPIRED, expired_at=now)
        elif (
            batch.status == BatchStatus.IN_PROGRESS
            and not batch.lines.filter(status=LineStatus.PENDING).exists()
        ):
            move(batch.id, BatchStatus.FINALIZING, finalizing_at=now)
            _finalize(batch, BatchStatus.COMPLETED, completed_at=timezone.now())
        batch.refresh_from_db(fields=["status"])
        return str(batch.status)


def _expire_unfinished(batch: Batch, now: Any) -> None:
    error = {"code": "batch_expired", "message": "the batch expired before this request ran"}
    expired = batch.lines.filter(status=LineStatus.PENDING).update(
        status=LineStatus.FAILED, error=error, finished_at=now
    )
    Batch.objects.filter(pk=batch.pk).update(failed=F("failed") + expired)


def _finalize(batch: Batch, to: str, **fields: Any) -> None:
    output = _write_file(batch, "output", _output_lines(batch))
    errors = _write_file(batch, "errors", _error_lines(batch))
    move(batch.id, to, output_file=output, error_file=errors, **fields)


def _write_file(batch: Batch, kind: str, lines: Iterator[bytes]) -> BatchFile | None:
    """The batch's output or error file, written a chunk at a time as its lines come; none
    without a line. Never refused by the owner's quota (the batch ran), but counted in it."""
    first = next(lines, None)
    if first is None:
        return None
    created = BatchFile.objects.create(
        tenant_id=batch.tenant_id,
        owner=batch.owner,
        purpose=FilePurpose.BATCH_OUTPUT,
        filename=f"{batch.id}_{kind}.jsonl",
    )
    created.bytes = created.write(itertools.chain([first], lines))
    created.save(update_fields=["bytes"])
    return created


def _jsonl(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def _output_lines(batch: Batch) -> Iterator[bytes]:
    for line in batch.lines.filter(status=LineStatus.DONE).order_by("line_no").iterator():
        yield _jsonl(
            {
                "id": line.request_id,
                "custom_id": line.custom_id,
                "response": line.response,
                "error": None,
            }
        )


def _error_lines(batch: Batch) -> Iterator[bytes]:
    for line in batch.lines.filter(status=LineStatus.FAILED).order_by("line_no").iterator():
        yield _jsonl(
            {
                "id": line.request_id,
                "custom_id": line.custom_id or None,
                "response": line.response,
                "error": line.error,
            }
        )


def requeue_stranded() -> list[str]:
    """Queue again every batch a worker owns whose lease ran out (its worker died, or its task
    was lost); each is marked queued first, so the next sweep leaves it to that task. One past
    its window is ended here instead (``finish``: expired, or cancelled), so a batch whose
    task keeps failing still ends. Returns the ids it queued or ended."""
    now = timezone.now()
    lapsed = Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    stranded = Batch.objects.filter(lapsed, status__in=WORKER_OWNED_STATUSES)
    rows = list(stranded.values_list("pk", "expires_at"))
    until = now + timedelta(seconds=settings.BATCH_QUEUED_SECONDS)
    taken = []
    for batch_id, expires_at in rows:
        if expires_at <= now:
            if _end_past_window(batch_id):
                taken.append(batch_id)
        elif Batch.objects.filter(lapsed, pk=batch_id).update(
            lease_owner=QUEUED, lease_until=until
        ):
            taken.append(batch_id)
            enqueue(RUN_BATCH_TASK, batch_id)
    return taken


def _end_past_window(batch_id: str) -> bool:
    if not claim(batch_id, SWEEPER):
        return False  # a worker took it meanwhile; its ``finish`` ends it
    try:
        finish(batch_id)
    except Exception:
        log.exception("the sweep could not end batch %s past its window", batch_id)
        return False
    finally:
        release(batch_id, SWEEPER)
    return True
