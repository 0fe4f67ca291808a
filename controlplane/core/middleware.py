from __future__ import annotations

import logging
import re
from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.debug import SafeExceptionReporterFilter

API_PREFIX = "/api/"
log = logging.getLogger("controlplane.api")


def _api_error(status: int, code: str, message: str) -> JsonResponse:
    """The API's one error shape (core/api.py), for answers given before DRF runs."""
    return JsonResponse({"error": {"code": code, "message": message}}, status=status)


class BodySizeLimitMiddleware:
    """Refuse a body over MAX_REQUEST_BODY_BYTES (or a path's own limit,
    ``BODY_LIMITS_BY_PATH``: the Batch API's uploads) with a JSON 413 before anything reads
    it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = next(
            (n for prefix, n in settings.BODY_LIMITS_BY_PATH.items() if request.path == prefix),
            settings.MAX_REQUEST_BODY_BYTES,
        )
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
        except ValueError:
            return _api_error(400, "bad_request", "Content-Length is not a number")
        if length > limit:
            return _api_error(
                413,
                "payload_too_large",
                f"request body is {length} bytes; the limit is {limit} bytes",
            )
        return self.get_response(request)


class ApiErrorMiddleware:
    """Under ``/api/`` every answer is JSON in the one error shape, in production and in DEBUG
    alike: an unhandled exception is a logged JSON 500 (never a traceback page, which would show
    settings), and a path no route matches is a JSON 404 rather than the dashboard's HTML."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (
            request.path.startswith(API_PREFIX)
            and response.status_code == 404
            and not response.get("Content-Type", "").startswith("application/json")
        ):
            return _api_error(404, "not_found", f"no API endpoint at {request.path}")
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not request.path.startswith(API_PREFIX):
            return None  # the dashboard's own 500 page
        log.error("unhandled error in %s %s", request.method, request.path, exc_info=exception)
        return _api_error(
            500, "server_error", "the control plane could not answer this request; it is logged"
        )


# Scripts and styles come from this server only (the dashboard has no inline script); inline
# style attributes stay allowed for the dashboard's bars and charts. The API's Swagger page
# loads its UI from its CDN with an inline bootstrap script, so it gets that one exception.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; object-src 'none'; base-uri 'self'; frame-ancestors 'none'; "
    "form-action 'self'"
)
SWAGGER_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
    "img-src 'self' data: https://cdn.jsdelivr.net; object-src 'none'; base-uri 'self'; "
    "frame-ancestors 'none'"
)


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        policy = (
            SWAGGER_POLICY if request.path.startswith("/api/v1/docs") else CONTENT_SECURITY_POLICY
        )
        response.headers.setdefault("Content-Security-Policy", policy)
        return response


class SecretSettingsFilter(SafeExceptionReporterFilter):
    """Error reports (the DEBUG page, mailed reports) also hide URLs that carry credentials,
    such as ``CELERY_BROKER_URL`` and ``DATABASE_URL``."""

    hidden_settings = re.compile(
        "API|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|URL|BROKER|BACKEND|DSN", flags=re.I
    )
