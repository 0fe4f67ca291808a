"""The Batch API's answers in OpenAI's shapes: file, batch and list objects, and errors."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import JsonResponse

from common.openai_errors import openai_error
from controlplane.batches.models import Batch, BatchFile


class BatchApiError(Exception):
    """A refusal of the Batch API, answered in OpenAI's error shape (common/openai_errors.py)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type_ = type_

    def response(self) -> JsonResponse:
        body = openai_error(self.message, type_=self.type_, code=self.code, param=self.param)
        return JsonResponse(body, status=self.status)


def not_found(kind: str, ident: str) -> BatchApiError:
    return BatchApiError(404, f"No {kind} with id {ident!r}", code="not_found", param="id")


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_object(f: BatchFile) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": _ts(f.created_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_object(b: Batch) -> dict[str, Any]:
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": {"object": "list", "data": b.errors} if b.errors else None,
        "input_file_id": b.input_file_ref,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": _ts(b.created_at),
        "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at),
        "completed_at": _ts(b.completed_at),
        "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at),
        "cancelling_at": _ts(b.cancelling_at),
        "cancelled_at": _ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": b.metadata,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
