"""The Batch API at the router's base URL: ``/v1/files*`` and ``/v1/batches*`` go to the
control plane, which stores the files and batches and runs them (docs/batches.md).

The router forwards a fixed map of routes (``ROUTES``), never a path join: the request's
raw path (before any percent-decoding) must match one route's pattern exactly, each id its
own strict pattern, and the upstream URL is built from the configured base and those parts
only, with the known query parameters encoded again. Anything else (dot segments raw or
encoded, encoded slashes, double encoding, another tail) is a 404 before anything leaves the
router; a known path with another method a 405 (decision record 53).

Who the control plane hears (decision record 53): a tenant's own key goes upstream as it
came, with no ``X-Syshax-Tenant``, and the control plane authenticates the tenant itself. Only
the router's own callers, which are no control-plane tenant (``router-key``, ``anonymous``),
go with the router's machine token and ``X-Syshax-Tenant`` naming them. The router's key
acting for a tenant is refused (403): the router holds no key of that tenant. Every request
is admitted as completions are (the tenant's RPM). The body streams through
(``router.api.uploads``); the control plane's status, body and content headers come back
unchanged. A standalone router answers 404; a control plane that does not answer is a 503.
All in OpenAI's error shape.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
from aiohttp import web
from yarl import URL

from common.tenants import TenantRecord, hash_key
from router.api.uploads import READ_CHUNK, BodyCutShort, Upload
from router.client.access import bearer, raw_path_of
from router.client.errors import RouterError
from router.client.tenants import ANONYMOUS, REQUEST_TENANT, ROUTER_TENANT, TENANT_HEADER
from router.request import refuse
from router.state import ROUTER_KEY, ControlPlaneLink

log = logging.getLogger("syshax.router")

PREFIXES = ("/v1/files", "/v1/batches")
# The largest body forwarded: the control plane's default file cap (BATCH_MAX_FILE_BYTES,
# 50 MiB) and a multipart upload's framing. The control plane refuses over its own cap.
MAX_UPLOAD_BYTES = 51 * 1024 * 1024
SENT_HEADERS = ("Content-Type", "Accept", "Idempotency-Key")
RELAYED_HEADERS = ("Content-Type", "Content-Disposition", "Retry-After")
SESSION_KEY: web.AppKey[list[aiohttp.ClientSession]] = web.AppKey("batch_session")

# The ids the control plane makes (``file-`` and ``batch_`` and 24 hex), with room to grow:
# letters and digits only, so no id can carry a dot, a slash or a percent sign.
ID_PATTERNS = {"file_id": r"file-[A-Za-z0-9]{1,64}", "batch_id": r"batch_[A-Za-z0-9]{1,64}"}


@dataclass(frozen=True)
class Route:
    """One Batch API route the router forwards: its method, its path (``{file_id}`` and
    ``{batch_id}`` stand for an id), the pattern a raw path must match whole, and the query
    parameters passed on."""

    name: str
    method: str
    template: str
    pattern: re.Pattern[str]
    query: tuple[str, ...] = ()


def _route(name: str, method: str, template: str, query: tuple[str, ...] = ()) -> Route:
    pattern = re.escape(template)
    for part, id_pattern in ID_PATTERNS.items():
        pattern = pattern.replace(re.escape("{" + part + "}"), f"(?P<{part}>{id_pattern})")
    return Route(name, method, template, re.compile(pattern, re.ASCII), query)


ROUTES = (
    _route("files.create", "POST", "/v1/files"),
    _route("files.list", "GET", "/v1/files", ("after", "limit", "purpose")),
    _route("files.retrieve", "GET", "/v1/files/{file_id}"),
    _route("files.content", "GET", "/v1/files/{file_id}/content"),
    _route("files.delete", "DELETE", "/v1/files/{file_id}"),
    _route("batches.create", "POST", "/v1/batches"),
    _route("batches.list", "GET", "/v1/batches", ("after", "limit")),
    _route("batches.retrieve", "GET", "/v1/batches/{batch_id}"),
    _route("batches.cancel", "POST", "/v1/batches/{batch_id}/cancel"),
)


def match_route(method: str, raw_path: str) -> tuple[Route, str]:
    """The route a request's method and raw path (no query) name, with the path to ask the
    control plane for, rebuilt from the route and the matched ids only; a 404 in OpenAI's
    shape for any other path, a 405 for a known one asked with another method."""
    allowed: list[str] = []
    for route in ROUTES:
        found = route.pattern.fullmatch(raw_path)
        if found is None:
            continue
        if route.method == method:
            return route, route.template.format(**found.groupdict())
        allowed.append(route.method)
    if allowed:
        raise RouterError(
            405,
            f"{raw_path} takes {' or '.join(allowed)}, not {method}",
            code="method_not_allowed",
        )
    raise RouterError(404, f"no route for {raw_path}", code="not_found")


def upstream_url(link: ControlPlaneLink, route: Route, path: str, http: web.Request) -> URL:
    """The control plane's URL for a matched route: the configured base, the fixed path and
    the route's known query parameters, encoded again (the rest are dropped)."""
    query = http.rel_url.query
    pairs = [
        f"{name}={quote(value, safe='')}"
        for name in route.query
        for value in query.getall(name, [])[:1]
    ]
    text = link.base_url.rstrip("/") + path + ("?" + "&".join(pairs) if pairs else "")
    return URL(text, encoded=True)


def add_routes(app: web.Application) -> None:
    """The two prefixes, before the app's catch-all (which refuses them too: the map is
    matched on the raw path in ``forward``)."""
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


def credentials(http: web.Request, link: ControlPlaneLink) -> dict[str, str]:
    """Who the control plane hears: the tenant's own key, or for the router's own callers
    the router's token and ``X-Syshax-Tenant`` naming them; a 403 for the router's key
    acting for a tenant (the router holds no key of it)."""
    tenant: TenantRecord = http.get(REQUEST_TENANT) or ANONYMOUS
    if tenant is ROUTER_TENANT or tenant is ANONYMOUS:
        return {"Authorization": f"Bearer {link.token}", TENANT_HEADER: tenant.name}
    token = bearer(http.headers.get("Authorization", ""))
    if TENANT_HEADER in http.headers or hash_key(token) not in tenant.key_hashes:
        raise RouterError(
            403,
            f"the Batch API takes a tenant's own key; {TENANT_HEADER} may not name a tenant "
            "here (the control plane authenticates the tenant by its key)",
            param=TENANT_HEADER,
            code="tenant_header_not_allowed",
        )
    return {"Authorization": f"Bearer {token.decode('utf-8', 'surrogateescape')}"}


async def forward(http: web.Request) -> web.StreamResponse:
    router = http.app[ROUTER_KEY]
    try:
        route, path = match_route(http.method, raw_path_of(http))
    except RouterError as err:
        raise refuse(router, "path", err) from None
    link = router.control_plane
    if link is None:
        raise RouterError(
            404,
            "the Batch API needs a router managed by the control plane; this router runs "
            "standalone",
            code="batch_api_unavailable",
        )
    try:
        headers = credentials(http, link)
    except RouterError as err:
        raise refuse(router, "tenant-header", err) from None
    tenant = http.get(REQUEST_TENANT) or ANONYMOUS
    admission = await router.tenants.admit_shared(tenant, None, 0)
    ok = False
    try:
        upload = await Upload.receive(http, max(MAX_UPLOAD_BYTES, router.config.max_body_bytes))
        try:
            headers.update({n: http.headers[n] for n in SENT_HEADERS if n in http.headers})
            headers.update(upload.headers())
            url = upstream_url(link, route, path, http)
            response, ok = await _relay(http, url, headers, upload)
        finally:
            upload.close()
        return response
    finally:
        router.tenants.settle(admission, 0, 0, ok=ok)


async def _relay(
    http: web.Request, url: URL, headers: dict[str, str], upload: Upload
) -> tuple[web.StreamResponse, bool]:
    """The control plane's answer, streamed back; and whether it was no server error."""
    response: web.StreamResponse | None = None
    try:
        async with _session(http.app).request(
            http.method, url, data=upload.data(), headers=headers, allow_redirects=False
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
            return response, upstream.status < 500
    except (aiohttp.ClientError, TimeoutError, BodyCutShort) as exc:
        if response is not None:
            return response, False  # the answer started: it ends here, cut short
        log.warning("the control plane did not answer %s %s: %s", http.method, http.path, exc)
        raise RouterError(
            503,
            "the control plane, which keeps the Batch API's files and batches, did not "
            "answer; try again shortly",
            type_="service_unavailable",
            code="control_plane_unavailable",
            retry_after=5.0,
        ) from None
