"""A minimal HTTP/1.1 client for timed streaming requests, on bare asyncio protocols.

Why not aiohttp for the timed path: with aiohttp every chunk wakes a coroutine, and at 256
concurrent streams on one core those wake-ups queue behind each other, so the stamp taken
when the coroutine finally runs lags the chunk's arrival by tens of milliseconds (measured:
docs/benchmarks.md, "Capacity"). Here ``data_received`` stamps each socket read with
``time.perf_counter()`` and stores the bytes; nothing else runs per chunk. The response is
parsed once it is complete (``common.http1``, the parser the router's engine client
uses too), and each SSE event gets the stamp of the read that completed it.

Only what an OpenAI-compatible server sends is supported: a status line, headers, and a body
that is chunked or has a Content-Length. Connections are kept alive and pooled per host.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

from common.http1 import FramingError, ResponseParser


class WireError(Exception):
    """The connection failed or the response could not be parsed."""


@dataclass(frozen=True)
class Head:
    status: int
    reason: str
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its last value
    keep_alive: bool


@dataclass
class Response:
    """A complete (or cut-off) response: its head, body pieces and when each arrived."""

    head: Head
    # (perf_counter of the socket read that brought it, payload), in order
    pieces: list[tuple[float, bytes]]
    complete: bool
    error: str = ""


class _Connection(asyncio.Protocol):
    """One TCP connection: stamps every read first. The head is parsed as it arrives; after
    it, a read is only stored with its stamp (a cheap look at its last bytes tells whether
    the body may be complete), and the stored reads are parsed once it is: at 256 streams on
    one core, parsing each read as it came delayed the stamps of the reads queued behind it
    (docs/benchmarks.md)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()
        self.pieces: list[tuple[float, bytes]] = []
        self.stored: list[tuple[float, bytes]] = []
        self.body_bytes = 0  # parsed body bytes plus stored raw bytes
        self.tail = b""  # the last bytes stored
        self.received = 0
        self.error = ""
        self.done: asyncio.Future[None] | None = None
        self.lost: BaseException | None = None
        self.closed = False

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's and uvloop's TCP transports are both write transports.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        arrived = time.perf_counter()  # first: the stamp is the point of this client
        self.received += len(data)
        parser = self.parser
        if not parser.head_complete:
            self._parse([(arrived, data)])
            return
        self.stored.append((arrived, data))
        self.body_bytes += len(data)
        if parser.chunked:
            # The last chunk (or a trailer's end), even when its bytes span two reads.
            self.tail = (self.tail + data)[-5:]
            maybe_complete = self.tail == b"0\r\n\r\n"
        else:
            length = parser.content_length
            maybe_complete = length is not None and self.body_bytes >= length
        if maybe_complete:
            self._parse_stored()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = exc or ConnectionResetError("the server closed the connection")
        self._parse_stored()
        self.parser.closed()
        self._finish()

    # -- parsing ----------------------------------------------------------------------------

    def _parse(self, reads: list[tuple[float, bytes]]) -> None:
        if self.error:
            return
        for arrived, data in reads:
            try:
                payload = self.parser.feed(data)
            except FramingError as exc:
                self.error = str(exc)
                self._finish()
                return
            if payload:
                self.pieces.append((arrived, payload))
                self.body_bytes += len(payload)
        if self.parser.complete:
            self._finish()

    def _parse_stored(self) -> None:
        stored, self.stored = self.stored, []
        self.body_bytes -= sum(len(data) for _, data in stored)
        self._parse(stored)

    # -- one exchange -----------------------------------------------------------------------

    def begin(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self.parser.reset()
        self.pieces, self.stored, self.body_bytes, self.received = [], [], 0, 0
        self.tail = b""
        self.error = ""
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def _finish(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def response(self) -> Response:
        """The exchange's response, as far as it arrived."""
        self._parse_stored()
        parser = self.parser
        if not parser.head_complete:
            raise WireError(
                self.error or f"no complete response head ({self.received} bytes arrived)"
            )
        head = Head(parser.status, parser.reason, dict(parser.headers), parser.keep_alive)
        return Response(head, self.pieces, parser.complete, self.error)


@dataclass
class Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, parts.port or default)


@dataclass
class ConnectionPool:
    """Idle keep-alive connections per origin; a connection serves one request at a time.

    A connection idle for longer than ``max_idle_s`` is closed rather than reused: servers
    drop idle keep-alive connections (uvicorn, which serves vLLM, after 5 s), and a request
    written just as the server closes would fail for no fault of the target.
    """

    connect_timeout_s: float = 30.0
    max_idle_s: float = 4.0
    idle: dict[tuple[str, str, int], list[tuple[float, _Connection]]] = field(default_factory=dict)

    async def acquire(self, origin: Origin) -> _Connection:
        key = (origin.scheme, origin.host, origin.port)
        pool = self.idle.setdefault(key, [])
        now = time.monotonic()
        while pool:
            since, connection = pool.pop()
            if connection.closed:
                continue
            if now - since <= self.max_idle_s:
                return connection
            if connection.transport is not None:
                connection.transport.close()
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context() if origin.scheme == "https" else None
        _, protocol = await asyncio.wait_for(
            loop.create_connection(_Connection, origin.host, origin.port, ssl=context),
            self.connect_timeout_s,
        )
        return protocol

    def release(self, origin: Origin, connection: _Connection, reusable: bool) -> None:
        if reusable and not connection.closed:
            key = (origin.scheme, origin.host, origin.port)
            self.idle.setdefault(key, []).append((time.monotonic(), connection))
        elif connection.transport is not None:
            connection.transport.close()

    def close(self) -> None:
        for pool in self.idle.values():
            for _, connection in pool:
                if connection.transport is not None:
                    connection.transport.close()
        self.idle.clear()


async def post(
    pool: ConnectionPool,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout_s: float,
) -> Response:
    """POST ``body`` and wait for the whole response; raises WireError or OSError."""
    return await request(pool, "POST", url, body, headers, timeout_s)


async def request(
    pool: ConnectionPool,
    method: str,
    url: str,
    body: bytes | None,
    headers: Mapping[str, str],
    timeout_s: float,
) -> Response:
    """One request (``body`` None: none, and no Content-Length) and its whole response;
    raises WireError or OSError."""
    origin = Origin.of(url)
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.host}:{origin.port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines += ["", ""]
    request = "\r\n".join(lines).encode("latin-1") + (body or b"")
    connection = await pool.acquire(origin)
    reusable = False
    try:
        done = connection.begin(request)
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            raise WireError(f"no complete response within {timeout_s:g} s") from None
        response = connection.response()
        if not response.complete:
            lost = connection.lost
            cut = f"connection lost mid-response: {lost!r}" if lost else "incomplete"
            response.error = response.error or cut
        reusable = response.complete and response.head.keep_alive and not connection.closed
        return response
    finally:
        pool.release(origin, connection, reusable)
