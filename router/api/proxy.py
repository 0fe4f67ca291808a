"""The catch-all: the engine API paths the router does not serve itself (``access.PROXIED``)
go to a GPU engine with the client's content headers only; any other path is a 404.

The client's raw path must be one of the listed paths exactly, and the listed path is what
goes upstream (decision record 53). Each request is admitted as completions are: it counts
against its tenant's RPM, and the model it names (or, naming none, the deployment it goes
to) must be one its tenant may use."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from common.tenants import TenantRecord
from router.client.access import NOT_RELAYED, forwarded_headers, proxied_path, raw_path_of
from router.client.errors import RouterError
from router.client.tenants import ANONYMOUS, REQUEST_TENANT
from router.client.validate import parse_body
from router.engines.transport import UpstreamFailed, request
from router.plan import unknown_model
from router.request import read_body, refuse, without_router_fields
from router.state import ROUTER_KEY, Deployment, Router


async def proxy(http: web.Request) -> web.StreamResponse:
    """The engine API paths the router does not serve itself (``access.PROXIED``: /version,
    /tokenize ...) go to a GPU engine, as sysHAX does, with the client's content headers
    only; any other path is a 404."""
    router = http.app[ROUTER_KEY]
    try:
        path = proxied_path(http.method, raw_path_of(http))
    except RouterError as err:
        raise refuse(router, "path", err) from None
    if not router.state.deployments:
        raise RouterError(404, f"no route for {path}", code="not_found")
    tenant = http.get(REQUEST_TENANT) or ANONYMOUS
    body = await read_body(http, router.config.max_body_bytes)
    parsed: dict[str, Any] = parse_body(body) if body else {}
    if body:
        body = without_router_fields(router, parsed, body)
    named = parsed.get("model")
    model = named if isinstance(named, str) else None
    allowed = _allowed_deployments(router, tenant) if model is None else None
    # Counted against the tenant's RPM (and its models) as a completion is; no tokens.
    admission = await router.tenants.admit_shared(tenant, model, 0)
    ok = False
    try:
        deployments = allowed or _model_deployments(router, model or "")
        response, ok = await _forward(router, http, deployments, path, body)
        return response
    finally:
        router.tenants.settle(admission, 0, 0, ok=ok)


def _allowed_deployments(router: Router, tenant: TenantRecord) -> list[Deployment]:
    """The deployments a request that names no model may go to: those of a model its tenant
    may use (a 403 when there is none)."""
    deployments = [d for d in router.state.deployments if tenant.allows_model(d.spec.model)]
    if not deployments:
        router.tenants.reject(tenant, "model")
        raise RouterError(
            403,
            f"tenant {tenant.name!r} may use none of the models this router serves "
            f"(its models: {', '.join(tenant.models)})",
            param="model",
            code="model_not_allowed",
        )
    return deployments


def _model_deployments(router: Router, model: str) -> list[Deployment]:
    deployments = router.state.by_model.get(model)
    if not deployments:
        raise unknown_model(router, model)
    return deployments


async def _forward(
    router: Router, http: web.Request, deployments: list[Deployment], path: str, body: bytes
) -> tuple[web.StreamResponse, bool]:
    """The engine's answer, streamed back; and whether it was no server error."""
    now = time.monotonic()
    gpu = next((d.gpu for d in deployments if d.gpu.available(now)), deployments[0].gpu)
    response: web.StreamResponse | None = None
    try:
        async with request(
            gpu.pool,
            path,
            body,
            first_byte=router.config.timeouts.first_byte,
            method=http.method.encode(),
            headers=forwarded_headers(http.headers),
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers=[
                    (name, value)
                    for name, value in upstream.header_items()
                    if name not in NOT_RELAYED
                ],
            )
            await response.prepare(http)
            async for data in upstream.iter_body():
                await response.write(data)
            await response.write_eof()
            return response, upstream.status < 500
    except UpstreamFailed as exc:
        if response is not None:
            return response, False  # the answer started: it ends here, cut short
        raise RouterError(
            502,
            f"GPU engine {gpu.url} did not answer: {exc}",
            type_="server_error",
            code="backend_error",
        ) from None
