"""Shared API pieces: the error shape, the health endpoint and conditional-GET helpers."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import (
    RequestDataTooBig,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import connection
from django.db.models import ProtectedError, RestrictedError
from django.http import HttpRequest
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import exceptions, serializers, status
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from common.errors import FieldError

HEALTH_SCHEMA = inline_serializer(
    "Health", {"status": serializers.CharField(), "database": serializers.CharField()}
)


def _first_message(detail: Any) -> str:
    if isinstance(detail, dict):
        for key, value in detail.items():
            inner = _first_message(value)
            return inner if key in ("non_field_errors", "detail") else f"{key}: {inner}"
    if isinstance(detail, list) and detail:
        return _first_message(detail[0])
    return str(detail)


class Conflict(exceptions.APIException):
    """409: the object's state or the objects that refer to it forbid this now."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"
    default_detail = "the object's state or its references forbid this now"


def _in_use(exc: ProtectedError | RestrictedError) -> Conflict:
    """Name what still refers to the object, e.g. ``still used by deployments: a, b``."""
    by_kind: dict[str, list[str]] = {}
    objects = exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
    for obj in objects:
        by_kind.setdefault(str(obj._meta.verbose_name_plural), []).append(str(obj))
    uses = "; ".join(
        f"{kind}: {', '.join(sorted(names)[:5])}{' ...' if len(names) > 5 else ''}"
        for kind, names in sorted(by_kind.items())
    )
    return Conflict(f"cannot delete it while it is still used by {uses}")


def _body_past_limit(exc: Exception) -> exceptions.ParseError:
    """Django's refusal of an oversized body, as the client's error naming the limit."""
    if isinstance(exc, TooManyFieldsSent):
        limit = f"{settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} form fields"
    elif isinstance(exc, TooManyFilesSent):
        limit = f"{settings.DATA_UPLOAD_MAX_NUMBER_FILES} files"
    else:
        limit = f"{settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes"
    return exceptions.ParseError(f"the request body has more than {limit}, the most accepted")


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Every API error is ``{"error": {"code", "message", "fields"}}``; never a stack trace."""
    if isinstance(exc, RequestDataTooBig | TooManyFieldsSent | TooManyFilesSent):
        exc = _body_past_limit(exc)
    elif isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(
            exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        )
    elif isinstance(exc, FieldError):
        exc = exceptions.ValidationError({exc.field: [exc.message]})
    elif isinstance(exc, ProtectedError | RestrictedError):
        exc = _in_use(exc)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    detail = response.data
    code = getattr(exc, "default_code", "error")
    if isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        if isinstance(codes, str):
            code = codes
    body: dict[str, Any] = {"code": code, "message": _first_message(detail)}
    if isinstance(exc, exceptions.ValidationError) and isinstance(detail, dict):
        body["fields"] = detail
    response.data = {"error": body}
    return response


@extend_schema(responses={200: HEALTH_SCHEMA, 503: HEALTH_SCHEMA})
@api_view(["GET"])
@authentication_classes([])
@permission_classes([])
def health(request: Request) -> Response:
    """Unauthenticated liveness and database check for load balancers and compose."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        database = "ok"
    except Exception:
        database = "unavailable"
    healthy = database == "ok"
    return Response(
        {"status": "ok" if healthy else "degraded", "database": database},
        status=status.HTTP_200_OK if healthy else status.HTTP_503_SERVICE_UNAVAILABLE,
    )


def etag_matches(request: HttpRequest | Request, etag: str) -> bool:
    return etag_listed(request.headers.get("If-None-Match", ""), etag)


def etag_listed(if_none_match: str, etag: str) -> bool:
    """Whether an ``If-None-Match`` header's value names ``etag`` (weakly or strongly) or ``*``."""
    candidates = {tag.strip() for tag in if_none_match.split(",")}
    return etag in candidates or f"W/{etag}" in candidates or "*" in candidates
