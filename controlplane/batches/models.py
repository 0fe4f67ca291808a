"""The Batch API's rows: uploaded files, batches and the lines each batch runs.

A batch's lines are copied out of its input file when it is validated; from then on each line
is a row whose status says whether it still has to run, so a worker that dies mid-batch
leaves the finished lines finished (docs/batches.md, "Restarts").
"""

from __future__ import annotations

import builtins
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

from django.db import models
from django.utils import timezone

from controlplane.batches.choices import BatchStatus, FilePurpose, LineStatus


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def new_file_id() -> str:
    return new_id("file-")


def new_batch_id() -> str:
    return new_id("batch_")


def new_request_id() -> str:
    return new_id("batch_req_")


class OwnedQuerySet(models.QuerySet[Any]):
    def owned_by(self, owner: str) -> OwnedQuerySet:
        return self.filter(owner=owner)


# A file's bytes are stored as ordered chunks of at most this many bytes (decision 0055).
CHUNK_BYTES = 1024 * 1024


class BatchFile(models.Model):
    """A file of the Batch API: an uploaded input (``batch``) or a batch's results
    (``batch_output``: its output and error files). Its bytes live in the database as
    :class:`BatchFileChunk` rows, written and read a chunk at a time, under a cap
    (``BATCH_MAX_FILE_BYTES``)."""

    id = models.CharField(primary_key=True, max_length=40, default=new_file_id, editable=False)
    # The caller's tenant; empty for the router's own key and an open router, whose callers
    # are no control-plane tenant. ``owner`` names either and scopes every lookup.
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    owner = models.CharField(max_length=64, db_index=True)
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [models.Index(fields=["owner", "-created_at"], name="batchfile_owner_time_idx")]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"

    def write(self, pieces: Iterable[builtins.bytes]) -> int:
        """Store ``pieces`` (of any sizes) as this file's chunks, after any it has; returns
        the bytes written. Only a chunk's worth is held at a time. ``bytes`` is the caller's
        to save."""
        index = self.chunks.count()
        pending = bytearray()
        written = 0
        for piece in pieces:
            pending += piece
            written += len(piece)
            while len(pending) >= CHUNK_BYTES:
                BatchFileChunk.objects.create(
                    file=self, index=index, data=bytes(pending[:CHUNK_BYTES])
                )
                del pending[:CHUNK_BYTES]
                index += 1
        if pending:
            BatchFileChunk.objects.create(file=self, index=index, data=bytes(pending))
        return written

    def iter_bytes(self) -> Iterator[builtins.bytes]:
        """The file's bytes a chunk at a time, each chunk read when it is needed."""
        indexes = list(self.chunks.order_by("index").values_list("index", flat=True))
        for index in indexes:
            data = self.chunks.filter(index=index).values_list("data", flat=True).first()
            if data is not None:
                yield bytes(data)


class BatchFileChunk(models.Model):
    """``CHUNK_BYTES`` (the last one fewer) of a file's bytes; ``index`` orders them."""

    file = models.ForeignKey(BatchFile, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        ordering = ["file", "index"]
        constraints = [
            models.UniqueConstraint(fields=["file", "index"], name="batchfilechunk_unique_index")
        ]

    def __str__(self) -> str:
        return f"{self.file_id}#{self.index}"


class Batch(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id, editable=False)
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    owner = models.CharField(max_length=64, db_index=True)
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(
        max_length=16, choices=BatchStatus.choices, default=BatchStatus.VALIDATING
    )
    # The input file's id stays named after the file is deleted (its lines were copied).
    input_file_ref = models.CharField(max_length=40)
    input_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    output_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    metadata = models.JSONField(null=True, blank=True)
    # Errors of the whole file (OpenAI's ``errors.data``): why a batch failed validation.
    errors = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # The worker running the batch holds a lease it renews as lines finish; a batch whose
    # lease ran out while it is active lost its worker, and the sweep queues it again.
    lease_owner = models.CharField(max_length=64, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "id"]
        verbose_name_plural = "batches"
        indexes = [
            models.Index(fields=["owner", "-created_at"], name="batch_owner_time_idx"),
            models.Index(fields=["status"], name="batch_status_idx"),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def finished(self) -> int:
        return self.completed + self.failed


class BatchLine(models.Model):
    """One request of a batch: a line of its input file, valid or not (an invalid line is
    ``failed`` from the start, with the reason, and goes to the error file)."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line_no = models.PositiveIntegerField(help_text="1-based line of the input file")
    request_id = models.CharField(max_length=40, default=new_request_id, editable=False)
    custom_id = models.CharField(max_length=512, blank=True)
    body = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=8, choices=LineStatus.choices, default=LineStatus.PENDING)
    # {"status_code", "request_id", "body"} of the router's answer.
    response = models.JSONField(null=True, blank=True)
    # {"code", "message", "param", "line"}: why the line failed.
    error = models.JSONField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "line_no"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "line_no"], name="batchline_unique_line")
        ]
        indexes = [models.Index(fields=["batch", "status"], name="batchline_status_idx")]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.line_no}"
