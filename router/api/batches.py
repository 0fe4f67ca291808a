"""The Batch API at the router's base URL: ``/v1/files*`` and ``/v1/batches*`` go to the
control plane, which stores the files and batches and runs them (docs/batches.md).

A request is forwarded as it came (method, path and query, body, content type) with the
router's control-plane token and ``X-Syshax-Tenant: <the caller's tenant>``, which the app
middleware authenticated; the control plane's status, body and content headers come back
unchanged. A standalone router has no control plane and answers 404; a control plane that
does not answer is a 503. Both in OpenAI's error shape.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from router.client.errors import RouterError
from router.client.tenants import ANONYMOUS_TENANT, REQUEST_TENANT, TENANT_HEADER
from router.state import ROUTER_KEY

log = logging.getLogger("syshax.router")

PREFIXES = ("/v1/files", "/v1/batches")
# The largest body forwarded: the control plane's default file cap (BATCH_MAX_FILE_BYTES,
# 50 MiB) and a multipart upload's framing. The control plane refuses over its own cap.
MAX_UPLOAD_BYTES = 51 * 1024 * 1024
READ_CHUNK = 256 * 1024
SENT_HEADERS = ("Content-Type", "Accept", "Idempotency-Key")
RELAYED_HEADERS = ("Content-Type", "Content-Disposition", "Retry-After")
SESSION_KEY: web.AppKey[list[aiohttp.ClientSession]] = web.AppKey("batch_session")


def add_routes(app: web.Application) -> None:
    """The two prefixes, before the app's catch-all."""
    app[SESSION_KEY] = []
    app.on_cleanup.append(_close_session)
    for prefix in PREFIXES:
        app.router.add_route("*", prefix, forward)
        app.router.add_route("*", prefix + "/{tail:.*}", forward)


async def _close_session(app: web.Application) -> None:
    for session in app[SESSION_KEY]:
        await session.close()
    app[SESSION_KEY].clear()


def _session(app: web.Application) -> aiohttp.ClientSession:
    sessions = app[SESSION_KEY]
    if not sessions:
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=120.0)
        sessions.append(aiohttp.ClientSession(timeout=timeout, auto_decompress=False))
    return sessions[0]


async def read_limited(http: web.Request, limit: int) -> bytes:
    """The request's body, refused with a 413 past ``limit`` bytes (by its Content-Length
    before any of it is read, or as it arrives)."""
    if http.content_length is not None and http.content_length > limit:
        raise _too_large(http.content_length, limit)
    chunks: list[bytes] = []
    size = 0
    while chunk := await http.content.read(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> RouterError:
    return RouterError(
        413,
        f"the request body is {size} bytes or more; the Batch API takes at most {limit} bytes",
        code="body_too_large",
    )


async def forward(http: web.Request) -> web.StreamResponse:
    router = http.app[ROUTER_KEY]
    link = router.control_plane
    if link is None:
        raise RouterError(
            404,
            "the Batch API needs a router managed by the control plane; this router runs "
            "standalone",
            code="batch_api_unavailable",
        )
    tenant = http.get(REQUEST_TENANT)
    body = await read_limited(http, max(MAX_UPLOAD_BYTES, router.config.max_body_bytes))
    headers = {name: http.headers[name] for name in SENT_HEADERS if name in http.headers}
    headers["Authorization"] = f"Bearer {link.token}"
    headers[TENANT_HEADER] = tenant.name if tenant is not None else ANONYMOUS_TENANT
    url = link.base_url + http.rel_url.raw_path_qs
    response: web.StreamResponse | None = None
    try:
        async with _session(http.app).request(
            http.method, url, data=body or None, headers=headers, allow_redirects=False
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={n: upstream.headers[n] for n in RELAYED_HEADERS if n in upstream.headers},
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(http)
            async for data in upstream.content.iter_chunked(READ_CHUNK):
                await response.write(data)
            await response.write_eof()
            return response
    except (aiohttp.ClientError, TimeoutError) as exc:
        if response is not None:
            return response  # the answer started: it ends here, cut short
        log.warning("the control plane did not answer %s %s: %s", http.method, http.path, exc)
        raise RouterError(
            503,
            "the control plane, which keeps the Batch API's files and batches, did not "
            "answer; try again shortly",
            type_="service_unavailable",
            code="control_plane_unavailable",
            retry_after=5.0,
        ) from None
