"""The catch-all: the engine API paths the router does not serve itself (``access.PROXIED``)
go to a GPU engine with the client's content headers only; any other path is a 404."""

from __future__ import annotations

import time

from aiohttp import web

from router.client.access import NOT_RELAYED, forwarded_headers, proxied_path
from router.client.errors import RouterError
from router.client.validate import parse_body
from router.engines.transport import UpstreamFailed, request
from router.request import read_body, refuse, without_router_fields
from router.state import ROUTER_KEY


async def proxy(http: web.Request) -> web.StreamResponse:
    """The engine API paths the router does not serve itself (``access.PROXIED``: /version,
    /tokenize ...) go to a GPU engine, as sysHAX does, with the client's content headers
    only; any other path is a 404."""
    router = http.app[ROUTER_KEY]
    try:
        path = proxied_path(http.method, http.path)
    except RouterError as err:
        raise refuse(router, "path", err) from None
    deployments = router.state.deployments
    if not deployments:
        raise RouterError(404, f"no route for {http.path}", code="not_found")
    now = time.monotonic()
    gpu = next((d.gpu for d in deployments if d.gpu.available(now)), deployments[0].gpu)
    headers = forwarded_headers(http.headers)
    body = await read_body(http, router.config.max_body_bytes)
    if body:
        body = without_router_fields(router, parse_body(body), body)
    response: web.StreamResponse | None = None
    try:
        async with request(
            gpu.pool,
            path,
            body,
            first_byte=router.config.timeouts.first_byte,
            method=http.method.encode(),
            headers=headers,
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
            return response
    except UpstreamFailed as exc:
        if response is not None:
            return response  # the answer started: it ends here, cut short
        raise RouterError(
            502,
            f"GPU engine {gpu.url} did not answer: {exc}",
            type_="server_error",
            code="backend_error",
        ) from None
