"""What every dashboard view shares: permission checks that answer with the friendly 403, and
the friendly 404 and 500 pages whatever ``DEBUG`` says."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.views import defaults

from controlplane.core.middleware import API_PREFIX

View = Callable[..., HttpResponse]
request_log = logging.getLogger("django.request")


def require_perm(perm: str) -> Callable[[View], View]:
    """Signed in, and holding ``perm`` (the same Django permission the REST API checks)."""

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.has_perm(perm):
                raise PermissionDenied(f"needs {perm}")
            return view(request, *args, **kwargs)

        return login_required(wrapped)

    return decorate


def int_param(request: HttpRequest, name: str, default: int = 0) -> int:
    raw = request.GET.get(name, "")
    return int(raw) if raw.isdigit() else default


class FriendlyErrorPages:
    """The friendly 404 and 500 pages with ``DEBUG`` on too.

    ``DEBUG`` is the laptop default (``controlplane.settings.local``, the ``syshax.env`` that
    ``syshax init`` writes), so ``syshax up`` runs with it, and Django would answer a missing
    page with its URL map and an error with a traceback and settings. Outside ``/api/``
    (``ApiErrorMiddleware`` answers there in JSON) this answers with ``templates/404.html``
    and ``templates/500.html`` instead, as Django's own handlers do without ``DEBUG``; the
    traceback goes to the log. Without ``DEBUG`` it does nothing."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    @staticmethod
    def _applies(request: HttpRequest) -> bool:
        return bool(settings.DEBUG) and not request.path.startswith(API_PREFIX)

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (
            response.status_code == 404
            and self._applies(request)
            and response.get("Content-Type", "").startswith("text/html")
        ):
            return defaults.page_not_found(request, Http404())
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not self._applies(request) or isinstance(exception, Http404 | PermissionDenied):
            return None  # a 404 is replaced above; a 403 is the friendly page already
        request_log.error(
            "Internal Server Error: %s",
            request.path,
            exc_info=exception,
            extra={"request": request},
        )
        return defaults.server_error(request)
