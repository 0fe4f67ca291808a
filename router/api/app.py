"""The aiohttp application: its routes, the API key check and the error shaping.

Every request but ``/health`` and ``/metrics`` is served as a tenant: the middleware finds it
from the request's key (a 401 in OpenAI's shape otherwise) and keeps it in
``http[REQUEST_TENANT]`` (router/client/tenants.py).

Every answer a client gets goes through ``errors_middleware``: a ``RouterError`` becomes
OpenAI's error shape, anything unexpected a 500 in that shape (never a stack trace). The
completions endpoints are ``router.request.serve``; the others are in ``endpoints`` and
``proxy``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from common.tenants import TenantRecord
from router.api.batches import add_routes as add_batch_routes
from router.api.endpoints import health, metrics_endpoint, models
from router.api.proxy import proxy
from router.client.access import raw_path_of
from router.client.errors import RouterError, error_response
from router.client.tenants import REQUEST_TENANT, TENANT_HEADER
from router.request import refuse, serve
from router.state import ROUTER_KEY, Router

log = logging.getLogger("syshax.router")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health", "/metrics"})


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    try:
        if request.path not in OPEN_PATHS:
            request[REQUEST_TENANT] = tenant_of(router, request)
        return await handler(request)
    except RouterError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status == 413:
            return error_response(RouterError(413, "request body too large", code="body_too_large"))
        return error_response(
            RouterError(exc.status, exc.reason, type_="invalid_request_error", code=str(exc.status))
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        # Log the trace for the operator; the client gets the OpenAI shape and no trace.
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(
            RouterError(500, "internal router error", type_="server_error", code="internal_error")
        )


def tenant_of(router: Router, request: web.Request) -> TenantRecord:
    """The tenant a request is served as: its key's (a 401 for none or an unknown one), or
    the one the router's own key names with X-Syshax-Tenant (router/client/tenants.py)."""
    tenants = router.tenants
    tenant = tenants.authenticate(request.headers.get("Authorization", ""))
    acting_for = request.headers.get(TENANT_HEADER)
    if acting_for is not None:
        tenant = tenants.act_as(tenant, acting_for)
    return tenant


COMPLETIONS_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


async def completions(http: web.Request) -> web.StreamResponse:
    """``/v1/completions`` and ``/v1/chat/completions``: ``router.request`` serves them. The
    raw path must be one of the two exactly (its path is what the engines are asked)."""
    router = http.app[ROUTER_KEY]
    raw_path = raw_path_of(http)
    if raw_path not in COMPLETIONS_PATHS:
        raise refuse(router, "path", RouterError(404, f"no route for {raw_path}", code="not_found"))
    return await serve(router, http)


def build_app(router: Router) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware], client_max_size=router.config.max_body_bytes
    )
    app[ROUTER_KEY] = router
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    add_batch_routes(app)  # /v1/files*, /v1/batches*: to the control plane
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app
