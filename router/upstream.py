"""Calls to one engine: connect, first-byte and idle-stream timeouts, failures as exceptions."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import aiohttp

from router.watchdog import WATCHDOG

if TYPE_CHECKING:
    from router.backends import Backend

JSON_HEADERS = {"Content-Type": "application/json"}


# Why an engine could not serve a request: the ``reason`` label of the router's
# ``failovers_total``. ``removed``: its deployment left the control plane's set.
FAILURE_CONNECT = "connect"
FAILURE_HTTP = "http"
FAILURE_TIMEOUT = "timeout"
FAILURE_BROKEN = "broken"
FAILURE_REMOVED = "removed"
FAILURE_REASONS = (FAILURE_CONNECT, FAILURE_HTTP, FAILURE_TIMEOUT, FAILURE_BROKEN, FAILURE_REMOVED)


class UpstreamFailed(Exception):
    """An engine could not serve a request. ``status``/``body`` are set for HTTP errors."""

    def __init__(
        self,
        backend: Backend,
        message: str,
        *,
        connect_failed: bool = False,
        timed_out: bool = False,
        status: int | None = None,
        body: bytes | None = None,
    ) -> None:
        super().__init__(f"{backend.role} engine {backend.url}: {message}")
        self.backend = backend
        self.connect_failed = connect_failed
        self.timed_out = timed_out
        self.status = status
        self.body = body
        self.recorded = False  # set once counted towards errors and ejection

    @property
    def client_error(self) -> bool:
        """The engine refused the request itself (4xx): the client's problem, not the engine's."""
        return self.status is not None and 400 <= self.status < 500

    @property
    def reason(self) -> str:
        if self.connect_failed:
            return FAILURE_CONNECT
        if self.status is not None:
            return FAILURE_HTTP
        return FAILURE_TIMEOUT if self.timed_out else FAILURE_BROKEN


class BackendRemoved(UpstreamFailed):
    """The engine's deployment left the deployment set while this request waited on it.

    Nothing is wrong with the engine as far as the router knows (the host may be silent,
    or the deployment stopped), so it is not counted towards errors or ejection."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, "removed from the deployment set")
        self.recorded = True

    @property
    def reason(self) -> str:
        return FAILURE_REMOVED


def session_of(backend: Backend) -> aiohttp.ClientSession:
    """The backend's pooled session; a backend closed after leaving the set has none."""
    if backend.session is None:
        raise BackendRemoved(backend)
    return backend.session


@asynccontextmanager
async def post(
    backend: Backend, path: str, body: bytes, *, first_byte: float
) -> AsyncIterator[aiohttp.ClientResponse]:
    """POST and yield the response once its headers arrived with a 2xx status."""
    session = session_of(backend)
    try:
        async with asyncio.timeout(first_byte):
            resp = await session.post(backend.url + path, data=body, headers=JSON_HEADERS)
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamFailed(backend, f"connect failed: {exc}", connect_failed=True) from None
    except TimeoutError:
        raise UpstreamFailed(
            backend, f"no response within {first_byte:g}s", timed_out=True
        ) from None
    except aiohttp.ClientError as exc:
        raise UpstreamFailed(backend, f"request failed: {exc!r}") from None
    ok = False
    try:
        if resp.status >= 300:
            try:
                async with asyncio.timeout(backend.timeouts.idle):
                    payload = await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                payload = b""
            raise UpstreamFailed(backend, f"HTTP {resp.status}", status=resp.status, body=payload)
        yield resp
        ok = True
    finally:
        if ok and resp.content.at_eof():
            resp.release()
        else:
            # Closing (not releasing) the connection tells the engine to abort the request.
            resp.close()


async def post_json(backend: Backend, path: str, body: dict[str, Any], *, first_byte: float) -> Any:
    """A non-streaming call; the whole answer must arrive within ``first_byte`` seconds."""
    try:
        async with asyncio.timeout(first_byte):
            async with post(
                backend, path, json.dumps(body).encode(), first_byte=first_byte
            ) as resp:
                raw = await resp.read()
    except TimeoutError:
        raise UpstreamFailed(backend, f"no answer within {first_byte:g}s", timed_out=True) from None
    except aiohttp.ClientError as exc:
        raise UpstreamFailed(backend, f"answer broken: {exc!r}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise UpstreamFailed(backend, "answer is not JSON") from None


async def iter_body(
    resp: aiohttp.ClientResponse, backend: Backend, first_byte: float | None = None
) -> AsyncIterator[bytes]:
    """Yield body bytes as they arrive, within ``first_byte`` for the first read and the
    backend's idle timeout for every later one."""
    loop = asyncio.get_running_loop()
    idle = backend.timeouts.idle
    limit = first_byte if first_byte is not None else idle
    watch = WATCHDOG.watch(resp, loop.time() + limit)
    try:
        while True:
            watch.deadline = loop.time() + limit
            try:
                data = await resp.content.readany()
            except aiohttp.ClientError as exc:
                if watch.fired:
                    message = f"silent for {limit:g}s"
                    raise UpstreamFailed(backend, message, timed_out=True) from None
                raise UpstreamFailed(backend, f"stream broken: {exc!r}") from None
            if watch.fired:
                raise UpstreamFailed(backend, f"silent for {limit:g}s", timed_out=True)
            if not data:
                return
            # Disarmed while the consumer holds the data: a slow client is not a slow engine.
            watch.deadline = math.inf
            limit = idle
            yield data
    finally:
        WATCHDOG.active.discard(watch)
