"""A minimal HTTP/1.1 client for the passthrough hot path.

aiohttp's client costs a few hundred microseconds of CPU per request (request objects,
header multidicts, stream reader); a passthrough needs none of that. This client writes the
request in one syscall on a pooled keep-alive connection and parses the status line and
the few header fields it needs. Each connection is an ``asyncio.Protocol``: body bytes are
de-chunked as they arrive, and once a stream runs, a ``direct`` callback hands each read's
payload straight to the client's socket from inside ``data_received`` - no task wake-up, no
extra event-loop turn per token. Anything the callback declines (the first bytes, before the
client's headers went out; the end of the stream; a client that is not keeping up) queues
for the coroutine that waits in :meth:`RawResponse.next`. Anything unusual (no length, an
upgrade) is an error, never a guess. Closing the connection is how the engine learns the
client left.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol, cast
from urllib.parse import urlsplit

from router.upstream import BackendRemoved, UpstreamFailed
from router.watchdog import WATCHDOG

if TYPE_CHECKING:
    from router.backends import Backend

MAX_HEAD = 1 << 16
# Reads queued for a busy coroutine before the engine socket stops being read.
MAX_PENDING = 64


class _WatchLike(Protocol):
    deadline: float


class _Broken(Exception):
    """The engine broke the HTTP exchange (closed, malformed framing)."""


class Conn(asyncio.Protocol):
    """One keep-alive connection to an engine."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        self.idle = math.inf
        self.reset()

    def reset(self) -> None:
        self.in_body = False
        self.buffer = b""  # unparsed bytes (head, or an incomplete chunk)
        self.chunked = False
        self.remaining: int | None = None  # Content-Length left; None: chunked or to-close
        self.finished = False
        self.error: _Broken | None = None
        self.pending: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.direct: Callable[[bytes], bool] | None = None
        self.paused = False
        self.watch: _WatchLike | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self.buffer += data
            if len(self.buffer) > MAX_HEAD and b"\r\n\r\n" not in self.buffer:
                self.error = _Broken("response head too large")
            self._wake()
            return
        watch = self.watch
        if watch is not None:
            watch.deadline = self.clock() + self.idle
        self._body(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.in_body and not self.finished and self.error is None:
            if self.remaining is None and not self.chunked:
                self.finished = True  # body delimited by close
            else:
                self.error = _Broken("engine closed the stream early")
        elif not self.in_body and self.error is None:
            self.error = _Broken(f"connection closed: {exc!r}" if exc else "connection closed")
        self._wake()

    # -- body ------------------------------------------------------------------------------

    def _body(self, data: bytes) -> None:
        if self.chunked:
            data = self.buffer + data if self.buffer else data
            try:
                payload, self.buffer, finished = _dechunk(data)
            except _Broken as exc:
                self.error = exc
                self._wake()
                return
        else:
            payload, finished = data, False
            if self.remaining is not None:
                self.remaining -= len(data)
                finished = self.remaining <= 0
        if finished:
            self.finished = True
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
            # The client is not keeping up: stop reading, and stop the idle clock too, since
            # a slow client is not a silent engine.
            self.transport.pause_reading()
            self.paused = True
            if self.watch is not None:
                self.watch.deadline = math.inf
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def head(self) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                head, self.buffer = self.buffer[: end + 4], self.buffer[end + 4 :]
                return head
            if self.error is not None:
                raise self.error
            await self._wait()

    def start_body(self, chunked: bool, length: int | None) -> None:
        self.in_body = True
        self.chunked = chunked
        self.remaining = length
        rest, self.buffer = self.buffer, b""
        if length == 0:
            self.finished = True
        elif rest:
            self._body(rest)

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
                    if self.watch is not None:
                        self.watch.deadline = self.clock() + self.idle
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


class RawPool:
    """Idle keep-alive connections to one engine."""

    def __init__(self, url: str, connect_timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"raw client supports http:// URLs only, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode()
        self.prefix = parts.path.rstrip("/").encode()
        self.connect_timeout = connect_timeout
        self.idle: list[Conn] = []
        self.closed = False  # the engine left the deployment set: no new connections

    async def acquire(self) -> tuple[Conn, bool]:
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
        async with asyncio.timeout(self.connect_timeout):
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


class RawResponse:
    def __init__(
        self,
        pool: RawPool,
        conn: Conn,
        status: int,
        keep_alive: bool,
        content_type: str,
        backend: Backend,
        first: float,
    ) -> None:
        self.pool = pool
        self.conn = conn
        self.status = status
        self.keep_alive = keep_alive
        self.content_type = content_type
        self.backend = backend
        self._idle = backend.timeouts.idle
        self._limit = first
        # One shared watchdog closes silent streams: ``first`` s for the first bytes, the
        # idle timeout between later reads, re-armed by an attribute store per read.
        self._watch = WATCHDOG.watch(conn, conn.clock() + first)
        conn.watch = self._watch
        conn.idle = self._idle

    def set_direct(self, direct: Callable[[bytes], bool] | None) -> None:
        self.conn.direct = direct

    async def next(self) -> tuple[bytes, bool]:
        """(payload, finished); raises ``UpstreamFailed`` when the engine breaks or stalls."""
        try:
            result = await self.conn.next()
        except _Broken as exc:
            if self._watch.fired:
                raise UpstreamFailed(
                    self.backend, f"silent for {self._limit:g}s", timed_out=True
                ) from None
            raise UpstreamFailed(self.backend, str(exc)) from None
        self._limit = self._idle
        return result

    async def iter_body(self) -> AsyncIterator[bytes]:
        while True:
            data, finished = await self.next()
            if data:
                yield data
            if finished:
                return

    async def read_all(self) -> bytes:
        return b"".join([data async for data in self.iter_body()])

    def finish(self) -> None:
        """Return the connection to the pool if the body was read to its end, else close it."""
        WATCHDOG.active.discard(self._watch)
        conn = self.conn
        conn.direct = None
        conn.watch = None
        if conn.finished and not conn.pending and self.keep_alive and not conn.closed:
            self.pool.release(conn)
        else:
            conn.close()


def _dechunk(buffer: bytes) -> tuple[bytes, bytes, bool]:
    """Split complete chunks off ``buffer``: (joined payloads, rest, saw the last chunk)."""
    parts: list[bytes] = []
    pos = 0
    end = len(buffer)
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            break
        size_field = buffer[pos:eol].split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise _Broken(f"bad chunk size {size_field[:20]!r}") from None
        if size == 0:
            # The last chunk; trailers (none from engines) end with an empty line.
            if buffer.find(b"\r\n", eol + 2) < 0:
                break
            return b"".join(parts), b"", True
        start = eol + 2
        if start + size + 2 > end:
            break
        parts.append(buffer[start : start + size])
        pos = start + size + 2
    return b"".join(parts), buffer[pos:], False


def _field(fields: bytes, name: bytes) -> bytes:
    """The value of header ``name`` in a lower-cased header block, or b"" if absent."""
    at = fields.find(b"\r\n" + name + b":")
    if at < 0:
        return b""
    start = at + len(name) + 3
    end = fields.find(b"\r\n", start)
    return fields[start : end if end >= 0 else len(fields)].strip()


async def request(
    pool: RawPool, backend: Backend, path: str, body: bytes, *, first_byte: float
) -> RawResponse:
    """POST ``body`` and return the response once its head arrived; raises ``UpstreamFailed``.
    Retries once when a pooled keep-alive connection turns out to be closed by the engine."""
    head = (
        b"POST "
        + pool.prefix
        + path.encode()
        + b" HTTP/1.1\r\nHost: "
        + pool.host_header
        + b"\r\nContent-Type: application/json\r\nAccept: */*\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    loop = asyncio.get_running_loop()
    for attempt in range(2):
        try:
            conn, reused = await pool.acquire()
        except (OSError, TimeoutError) as exc:
            if pool.closed:
                raise BackendRemoved(backend) from None
            raise UpstreamFailed(backend, f"connect failed: {exc!r}", connect_failed=True) from None
        # The shared watchdog, not a timer per request, enforces the first-byte timeout: it
        # closes the socket, which ends the wait below.
        watch = WATCHDOG.watch(conn, loop.time() + first_byte)
        try:
            assert conn.transport is not None
            conn.transport.write(head + body)
            raw = await conn.head()
        except _Broken as exc:
            conn.close()
            if watch.fired:
                raise UpstreamFailed(
                    backend, f"no response within {first_byte:g}s", timed_out=True
                ) from None
            if reused and attempt == 0:
                continue
            raise UpstreamFailed(backend, f"request failed: {exc}") from None
        except BaseException:
            # Cancelled (the client left): closing the socket makes the engine abort.
            conn.close()
            raise
        finally:
            WATCHDOG.active.discard(watch)
        break
    first_line, _, fields = raw.partition(b"\r\n")
    try:
        status = int(first_line.split(b" ", 2)[1])
    except (IndexError, ValueError):
        conn.close()
        raise UpstreamFailed(backend, f"malformed status line {first_line[:40]!r}") from None
    # Only four fields matter; look them up in the lower-cased block, not line by line.
    fields = b"\r\n" + fields.lower()
    chunked = b"chunked" in _field(fields, b"transfer-encoding")
    length_field = _field(fields, b"content-length")
    try:
        length = int(length_field) if length_field and not chunked else None
    except ValueError:
        conn.close()
        raise UpstreamFailed(backend, f"bad content-length {length_field[:20]!r}") from None
    keep_alive = b"close" not in _field(fields, b"connection")
    content_type = _field(fields, b"content-type").split(b";")[0].decode("latin-1")
    content_type = content_type or "application/json"
    if not chunked and length is None:
        keep_alive = False  # body ends when the engine closes
    conn.start_body(chunked, length)
    return RawResponse(pool, conn, status, keep_alive, content_type, backend, first_byte)
