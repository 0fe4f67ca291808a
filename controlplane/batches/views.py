"""OpenAI's ``/v1/files`` and ``/v1/batches``, as the official client calls them.

Thin: each view authenticates the caller (``auth``), calls a service and answers in OpenAI's
shapes (``shapes``); every failure is OpenAI's error shape, never a page or a trace.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from controlplane.batches import services
from controlplane.batches.auth import Caller, authenticate
from controlplane.batches.choices import FilePurpose
from controlplane.batches.models import CHUNK_BYTES, Batch, BatchFile
from controlplane.batches.shapes import BatchApiError, batch_object, file_object, list_object

log = logging.getLogger("controlplane.batches")

View = Callable[..., HttpResponseBase]


def openai_view(*methods: str) -> Callable[[Callable[..., HttpResponseBase]], View]:
    """Authenticate, allow ``methods`` only, and answer every failure in OpenAI's shape."""

    def decorate(handler: Callable[..., HttpResponseBase]) -> View:
        @csrf_exempt
        @functools.wraps(handler)
        def view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            try:
                if request.method not in methods:
                    raise BatchApiError(
                        405,
                        f"{request.method} is not allowed here; use {' or '.join(methods)}",
                        code="method_not_allowed",
                    )
                caller = authenticate(request)
                return handler(request, caller, *args, **kwargs)
            except BatchApiError as err:
                return err.response()
            except RequestDataTooBig as exc:
                return BatchApiError(413, str(exc), code="body_too_large").response()
            except Exception:
                log.exception("unhandled error in %s %s", request.method, request.path)
                return BatchApiError(
                    500,
                    "the control plane could not answer this request; it is logged",
                    type_="server_error",
                    code="server_error",
                ).response()

        return view

    return decorate


def _json_body(request: HttpRequest) -> dict[str, Any]:
    try:
        data = json.loads(request.body or b"{}")
    except ValueError as exc:
        raise BatchApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BatchApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


@openai_view("GET", "POST")
def files(request: HttpRequest, caller: Caller) -> HttpResponse:
    if request.method == "POST":
        upload = request.FILES.get("file")
        if upload is None:
            raise BatchApiError(
                400, "a multipart field 'file' is required", code="missing_file", param="file"
            )
        # Django spooled a large upload to a temporary file; it is stored a chunk at a time.
        created = services.create_file(
            caller,
            filename=upload.name or "",
            purpose=request.POST.get("purpose", ""),
            size=upload.size or 0,
            pieces=upload.chunks(CHUNK_BYTES),
        )
        return JsonResponse(file_object(created))
    rows = BatchFile.objects.owned_by(caller.owner)
    purpose = request.GET.get("purpose")
    if purpose:
        if purpose not in FilePurpose.values:
            raise BatchApiError(
                400,
                f"purpose must be one of {', '.join(FilePurpose.values)}",
                code="invalid_purpose",
                param="purpose",
            )
        rows = rows.filter(purpose=purpose)
    found, more = services.page(
        rows, after=request.GET.get("after"), limit=request.GET.get("limit"), kind="file"
    )
    return JsonResponse(list_object([file_object(f) for f in found], more))


@openai_view("GET", "DELETE")
def file_detail(request: HttpRequest, caller: Caller, file_id: str) -> HttpResponse:
    if request.method == "DELETE":
        services.delete_file(caller, file_id)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    return JsonResponse(file_object(services.owned_file(caller, file_id)))


@openai_view("GET")
def file_content(request: HttpRequest, caller: Caller, file_id: str) -> HttpResponseBase:
    found = services.owned_file(caller, file_id)
    # Each stored chunk is read as it is sent: a 50 MiB file is never whole in memory.
    response = StreamingHttpResponse(found.iter_bytes(), content_type="application/octet-stream")
    response["Content-Length"] = str(found.bytes)
    response["Content-Disposition"] = f'attachment; filename="{found.filename}"'
    return response


@openai_view("GET", "POST")
def batches(request: HttpRequest, caller: Caller) -> HttpResponse:
    if request.method == "POST":
        data = _json_body(request)
        created = services.create_batch(
            caller,
            input_file_id=data.get("input_file_id"),
            endpoint=data.get("endpoint"),
            completion_window=data.get("completion_window"),
            metadata=data.get("metadata"),
        )
        return JsonResponse(batch_object(created))
    found, more = services.page(
        Batch.objects.owned_by(caller.owner),
        after=request.GET.get("after"),
        limit=request.GET.get("limit"),
        kind="batch",
    )
    return JsonResponse(list_object([batch_object(b) for b in found], more))


@openai_view("GET")
def batch_detail(request: HttpRequest, caller: Caller, batch_id: str) -> HttpResponse:
    return JsonResponse(batch_object(services.owned_batch(caller, batch_id)))


@openai_view("POST")
def batch_cancel(request: HttpRequest, caller: Caller, batch_id: str) -> HttpResponse:
    return JsonResponse(batch_object(services.cancel_batch(caller, batch_id)))


@csrf_exempt
def unknown(request: HttpRequest, rest: str = "") -> HttpResponse:
    return BatchApiError(
        404, f"no endpoint at {request.path} on the control plane", code="not_found"
    ).response()
