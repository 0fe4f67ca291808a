"""What every dashboard view shares: permission checks that answer with the friendly 403."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

View = Callable[..., HttpResponse]


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
