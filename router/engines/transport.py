"""The router's one HTTP/1.1 client for engines: passthrough, PD, tokenize, scrapes, proxy.

A general client (aiohttp's) costs a few hundred microseconds of CPU per request (request
objects, header multidicts, a stream reader); relaying an engine's stream needs none of it.
Here a request is one write on a pooled keep-alive connection, and the response head is
searched for the few fields that matter. Each connection is an ``asyncio.Protocol``: body
bytes are de-chunked as they arrive (``common.http1``), and once a passthrough stream
runs, a ``direct`` callback hands each read's payload straight to the client's socket from
inside ``data_received`` - no task wake-up, no extra event-loop turn per token. Anything the
callback declines (the first bytes, before the client's headers went out; the end of the
stream; a client that is not keeping up) queues for the coroutine waiting in
:meth:`EngineResponse.next`. Anything unusual (no length, an upgrade) is an error, never a
guess. Closing the connection is how the engine learns the client left.

Every wait has one deadline in ``router.engines.deadlines``: the first bytes within ``first_byte``
seconds, then the idle timeout between reads (held while the consumer holds the data: a slow
client is not a silent engine), or one deadline for the whole exchange (``idle=None``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from common.http1 import FramingError, ResponseParser
from router.engines.deadlines import DEADLINES, Deadline

MAX_HEAD = 1 << 16
# Reads queued for a busy coroutine before the engine socket stops being read.
MAX_PENDING = 64
# A JSON request's head lines after the Host line (a traced request adds its traceparent).
JSON_HEADERS = b"Content-Type: application/json\r\nAccept: */*\r\n"
# The request's own idle timeout is the pool's unless a call says otherwise.
_POOL_IDLE = -1.0

# Why an engine could not serve a request: the ``reason`` label of the router's
# ``failovers_total``. ``removed``: its deployment left the control plane's set.
FAILURE_CONNECT = "connect"
FAILURE_HTTP = "http"
FAILURE_TIMEOUT = "timeout"
FAILURE_BROKEN = "broken"
FAILURE_REMOVED = "removed"
FAILURE_REASONS = (FAILURE_CONNECT, FAILURE_HTTP, FAILURE_TIMEOUT, FAILURE_BROKEN, FAILURE_REMOVED)


class Engine(Protocol):
    """An engine as a failure names it: its URL and its role (``gpu`` or ``cpu``). A pool is
    one, and so is the router's ``Backend``."""

    @property
    def url(self) -> str: ...

    @property
    def role(self) -> str: ...


class UpstreamFailed(Exception):
    """An engine could not serve a request. ``status``/``body`` are set for HTTP errors.

    It names the engine (``url``, ``role``) and nothing more: whoever called the engine
    counts the failure against it (``recorded``)."""

    def __init__(
        self,
        engine: Engine,
        message: str,
        *,
        connect_failed: bool = False,
        timed_out: bool = False,
        status: int | None = None,
        body: bytes | None = None,
    ) -> None:
        super().__init__(f"{engine.role} engine {engine.url}: {message}")
        self.url = engine.url
        self.role = engine.role
        self.detail = message  # what failed, without the engine's name
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

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine, "removed from the deployment set")
        self.recorded = True

    @property
    def reason(self) -> str:
        return FAILURE_REMOVED


class _Broken(Exception):
    """The engine broke the HTTP exchange (closed, malformed framing)."""


class Conn(asyncio.Protocol):
    """One keep-alive connection to an engine."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.clock = asyncio.get_running_loop().time
        self.parser = ResponseParser()
        self.reset()

    def reset(self) -> None:
        self.parser.reset()
        self.head_bytes = 0
        self.error: _Broken | None = None
        self.pending: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.direct: Callable[[bytes], bool] | None = None
        self.paused = False
        self.deadline: Deadline | None = None
        # Seconds the next wait may last (first bytes, then idle); None: one fixed deadline.
        self.limit: float | None = None
        self.idle: float | None = None

    @property
    def finished(self) -> bool:
        return self.parser.complete

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        in_body = parser.head_complete
        deadline = self.deadline
        # Moved only while the coroutine waits (or the direct callback writes for it).
        if in_body and deadline is not None and self.idle is not None and self.waiter is not None:
            deadline.at = self.clock() + self.idle
        try:
            payload = parser.feed(data)
        except FramingError as exc:
            self.error = _Broken(str(exc))
            self._wake()
            return
        if not in_body:
            self.head_bytes += len(data)
            if payload:
                self.pending.append(payload)  # the first body bytes came with the head
            if parser.head_complete:
                self._wake()
            elif self.head_bytes > MAX_HEAD:
                self.error = _Broken("response head too large")
                self._wake()
            return
        self._deliver(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        parser = self.parser
        if self.error is None and not parser.closed():
            if parser.head_complete:
                self.error = _Broken("engine closed the stream early")
            else:
                self.error = _Broken(f"connection closed: {exc!r}" if exc else "connection closed")
        self._wake()

    # -- body ------------------------------------------------------------------------------

    def _deliver(self, payload: bytes) -> None:
        if self.parser.complete:
            if payload:
                self.pending.append(payload)
            self._wake()
            return
        if not payload:
            return
        waiter = self.waiter
        # The callback may only write while the coroutine is parked, or bytes could overtake
        # what the coroutine is writing.
        if (
            not self.pending
            and self.direct is not None
            and waiter is not None
            and not waiter.done()
            and self.direct(payload)
        ):
            return
        self.pending.append(payload)
        if len(self.pending) >= MAX_PENDING and self.transport is not None:
            # The client is not keeping up: stop reading, and hold the idle clock.
            self.transport.pause_reading()
            self.paused = True
            if self.deadline is not None and self.idle is not None:
                self.deadline.hold()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        deadline = self.deadline
        if deadline is not None and self.limit is not None and deadline.at == math.inf:
            deadline.at = self.clock() + self.limit
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def head(self) -> ResponseParser:
        """Wait for the response's status line and header fields."""
        while not self.parser.head_complete:
            if self.error is not None:
                raise self.error
            await self._wait()
        return self.parser

    async def next(self) -> tuple[bytes, bool]:
        """The payload queued since the last call (b"" at the end) and whether the body is
        complete. Raises ``_Broken`` when the engine broke the stream."""
        while True:
            if self.pending:
                payload = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
                self.pending.clear()
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                if self.deadline is not None and self.idle is not None:
                    self.deadline.hold()  # until the consumer waits again
                    self.limit = self.idle
                return payload, self.finished
            if self.finished:
                return b"", True
            if self.error is not None:
                raise self.error
            await self._wait()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class EnginePool:
    """Idle keep-alive connections to one engine, and the timeouts of its requests: what
    :func:`request` needs to reach it."""

    def __init__(self, url: str, role: str, connect_timeout: float, idle_timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"engine URLs must be http://, got {url!r}")
        self.url = url
        self.role = role
        self.host = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode()
        self.prefix = parts.path.rstrip("/").encode()
        self.connect_timeout = connect_timeout
        # The longest silence inside a streamed answer, unless a request says otherwise.
        self.idle_timeout = idle_timeout
        self.idle: list[Conn] = []
        self.closed = False  # the engine left the deployment set: no new connections

    async def acquire(self, connect_timeout: float | None = None) -> tuple[Conn, bool]:
        """A connection and whether it was reused (a reused one may have been closed)."""
        if self.closed:
            raise ConnectionRefusedError("the engine left the deployment set")
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reset()
                return conn, True
            conn.close()
        loop = asyncio.get_running_loop()
        limit = self.connect_timeout if connect_timeout is None else connect_timeout
        async with DEADLINES.cancel_after(limit):
            _, conn = await loop.create_connection(Conn, self.host, self.port)
        return conn, False

    def release(self, conn: Conn) -> None:
        if self.closed:
            conn.close()
        else:
            self.idle.append(conn)

    def close(self) -> None:
        """Close the idle connections and take no new ones; those in use finish first."""
        self.closed = True
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class EngineResponse:
    """An engine's answer whose head arrived; its body is read with ``next``."""

    def __init__(self, pool: EnginePool, conn: Conn) -> None:
        self.pool = pool
        self.conn = conn
        parser = conn.parser
        self.status = parser.status
        self.keep_alive = parser.keep_alive and parser.delimited

    def header(self, name: str) -> str:
        return self.conn.parser.header(name)

    @property
    def content_type(self) -> str:
        return self.header("content-type").split(";")[0].strip() or "application/json"

    def header_items(self) -> list[tuple[str, str]]:
        """Every header field, names lower-cased (for relaying them)."""
        return list(self.conn.parser.headers)

    async def raise_for_status(self) -> None:
        """An answer of 300 or more is an ``UpstreamFailed`` carrying the engine's body."""
        if self.status >= 300:
            try:
                body = await self.read_all()
            except UpstreamFailed:
                body = b""
            raise UpstreamFailed(self.pool, f"HTTP {self.status}", status=self.status, body=body)

    def set_direct(self, direct: Callable[[bytes], bool] | None) -> None:
        self.conn.direct = direct

    @property
    def direct_set(self) -> bool:
        return self.conn.direct is not None

    async def next(self) -> tuple[bytes, bool]:
        """(payload, finished); raises ``UpstreamFailed`` when the engine breaks or stalls."""
        conn = self.conn
        try:
            return await conn.next()
        except _Broken as exc:
            if conn.deadline is not None and conn.deadline.fired:
                what = f"silent for {conn.limit:g}s" if conn.limit else "no answer in time"
                raise UpstreamFailed(self.pool, what, timed_out=True) from None
            raise UpstreamFailed(self.pool, str(exc)) from None

    async def iter_body(self) -> AsyncIterator[bytes]:
        while True:
            data, finished = await self.next()
            if data:
                yield data
            if finished:
                return

    async def read_all(self) -> bytes:
        return b"".join([data async for data in self.iter_body()])

    def _finish(self) -> None:
        """Return the connection to the pool if the body was read to its end, else close it
        (which tells the engine to abort the request)."""
        conn = self.conn
        conn.direct = None
        conn.deadline = None
        if conn.finished and not conn.pending and self.keep_alive and not conn.closed:
            self.pool.release(conn)
        else:
            conn.close()


@asynccontextmanager
async def request(
    pool: EnginePool,
    path: str,
    body: bytes = b"",
    *,
    first_byte: float,
    method: bytes = b"POST",
    headers: bytes = JSON_HEADERS,
    idle: float | None = _POOL_IDLE,
) -> AsyncIterator[EngineResponse]:
    """Send a request and yield the response once its head arrived; raises
    ``UpstreamFailed``. ``idle`` is the silence allowed between body reads (the pool's
    by default); None puts the whole exchange under the ``first_byte`` deadline. Retries
    once when a pooled keep-alive connection turns out to be closed by the engine. The
    connection goes back to the pool when the body was read to its end."""
    if idle == _POOL_IDLE:
        idle = pool.idle_timeout
    message = (
        method
        + b" "
        + pool.prefix
        + path.encode()
        + b" HTTP/1.1\r\nHost: "
        + pool.host_header
        + b"\r\n"
        + headers
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    connect = min(pool.connect_timeout, first_byte) if idle is None else None
    for attempt in range(2):
        try:
            conn, reused = await pool.acquire(connect)
        except (OSError, TimeoutError) as exc:
            if pool.closed:
                raise BackendRemoved(pool) from None
            detail = "no connection within the timeout" if isinstance(exc, TimeoutError) else exc
            raise UpstreamFailed(pool, f"connect failed: {detail!r}", connect_failed=True) from None
        with DEADLINES.closing(conn, first_byte) as deadline:
            conn.deadline = deadline
            conn.limit = first_byte if idle is not None else None
            conn.idle = idle
            try:
                assert conn.transport is not None
                conn.transport.write(message)
                await conn.head()
            except _Broken as exc:
                conn.close()
                if deadline.fired:
                    raise UpstreamFailed(
                        pool, f"no response within {first_byte:g}s", timed_out=True
                    ) from None
                if reused and attempt == 0:
                    continue
                raise UpstreamFailed(pool, f"request failed: {exc}") from None
            except BaseException:
                # Cancelled (the client left): closing the socket makes the engine abort.
                conn.close()
                raise
            response = EngineResponse(pool, conn)
            if idle is not None:
                deadline.at = conn.clock() + first_byte  # for the first body bytes
            try:
                yield response
            finally:
                response._finish()
            return


async def call_json(
    pool: EnginePool,
    path: str,
    body: dict[str, Any],
    *,
    within: float,
    what: str = "",
    headers: bytes = JSON_HEADERS,
) -> Any:
    """A non-streaming JSON call whose whole answer must arrive within ``within`` seconds;
    a status of 300 or more is an ``UpstreamFailed`` with the engine's body."""
    label = what or path
    data = json.dumps(body).encode()
    async with request(pool, path, data, first_byte=within, idle=None, headers=headers) as resp:
        try:
            raw = await resp.read_all()
        except UpstreamFailed as exc:
            if exc.timed_out:
                raise UpstreamFailed(
                    pool, f"{label}: no answer within {within:g}s", timed_out=True
                ) from None
            raise
        if resp.status >= 300:
            raise UpstreamFailed(
                pool, f"{label} answered HTTP {resp.status}", status=resp.status, body=raw
            )
    try:
        return json.loads(raw)
    except ValueError:
        raise UpstreamFailed(pool, f"{label}: the answer is not JSON") from None
