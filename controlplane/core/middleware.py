from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


class BodySizeLimitMiddleware:
    """Refuse a body over MAX_REQUEST_BODY_BYTES with a JSON 413 before anything reads it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.MAX_REQUEST_BODY_BYTES
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
        except ValueError:
            return JsonResponse(
                {"error": {"code": "bad_request", "message": "Content-Length is not a number"}},
                status=400,
            )
        if length > limit:
            return JsonResponse(
                {
                    "error": {
                        "code": "payload_too_large",
                        "message": f"request body is {length} bytes; the limit is {limit} bytes",
                    }
                },
                status=413,
            )
        return self.get_response(request)
