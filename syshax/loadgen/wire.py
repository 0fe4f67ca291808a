"""A minimal HTTP/1.1 client for timed streaming requests, on bare asyncio protocols.

Why not aiohttp for the timed path: with aiohttp every chunk wakes a coroutine, and at 256
concurrent streams on one core those wake-ups queue behind each other, so the stamp taken
when the coroutine finally runs lags the chunk's arrival by tens of milliseconds (measured:
docs/benchmarks.md, "Capacity"). Here ``data_received`` stamps each socket read with
``time.perf_counter()`` and only stores the bytes; nothing else runs per chunk. The response
is parsed once it is complete, and each SSE event gets the stamp of the read that completed it.

Only what an OpenAI-compatible server sends is supported: a status line, headers, and a body
that is chunked or has a Content-Length. Connections are kept alive and pooled per host.
"""

from __future__ import annotations

import asyncio
import bisect
import socket
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast
from urllib.parse import urlsplit

_HEAD_END = b"\r\n\r\n"
# A chunked body ends with a zero-size chunk; an SSE payload ends with a blank line and its
# chunk with CRLF, so these bytes at the end of a read cannot be the middle of an event.
_CHUNKED_END = b"\r\n0\r\n\r\n"


class WireError(Exception):
    """The connection failed or the response could not be parsed."""


@dataclass
class Head:
    status: int
    reason: str
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its last value

    # Cached: data_received asks on every socket read, and the headers never change.
    @cached_property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @cached_property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.strip().isdigit() else None

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


def parse_head(raw: bytes) -> Head:
    """Parse a status line and headers (without the blank line that ends them)."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise WireError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return Head(int(parts[1]), parts[2] if len(parts) > 2 else "", headers)


def decode_chunked(body: bytes, start: int) -> tuple[list[tuple[int, bytes]], bool]:
    """Split a chunked body into (offset just past the chunk, payload) pairs.

    ``start`` is the body's offset in the whole response, so offsets are response offsets.
    Returns the chunks and whether the terminating zero-size chunk was seen.
    """
    chunks: list[tuple[int, bytes]] = []
    position = 0
    while True:
        line_end = body.find(b"\r\n", position)
        if line_end < 0:
            return chunks, False
        size_text = body[position:line_end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise WireError(f"bad chunk size {size_text[:20]!r}") from None
        if size == 0:
            return chunks, True
        data_start = line_end + 2
        data_end = data_start + size
        if data_end + 2 > len(body):
            return chunks, False
        chunks.append((start + data_end + 2, body[data_start:data_end]))
        position = data_end + 2


@dataclass
class Response:
    """A complete (or cut-off) response: its head, body pieces and when each arrived."""

    head: Head
    # (perf_counter of the socket read that completed it, payload), in order
    pieces: list[tuple[float, bytes]]
    complete: bool
    error: str = ""


class _Connection(asyncio.Protocol):
    """One TCP connection; stamps and stores every read, and nothing more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reads: list[bytes] = []
        self.read_times: list[float] = []
        self.read_ends: list[int] = []  # response offset just past each read
        self.size = 0
        self.head_size = 0  # bytes of status line and headers incl. the blank line; 0: unknown
        self.head: Head | None = None
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
        self.read_times.append(time.perf_counter())
        self.reads.append(data)
        self.size += len(data)
        self.read_ends.append(self.size)
        head = self.head
        if head is None or (head.chunked and data.endswith(b"0\r\n\r\n")):
            self._check_complete()
        elif head.content_length is not None and self.size >= self.head_size + head.content_length:
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = exc or ConnectionResetError("the server closed the connection")
        self._finish()

    # -- one exchange -----------------------------------------------------------------------

    def begin(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self.reads, self.read_times, self.read_ends = [], [], []
        self.size, self.head_size, self.head = 0, 0, None
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def _finish(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _read_head(self, raw: bytes) -> Head | None:
        """The response head, parsed once it has fully arrived (None until then)."""
        if self.head is None:
            end = raw.find(_HEAD_END)
            if end < 0:
                return None
            self.head = parse_head(raw[:end])
            self.head_size = end + len(_HEAD_END)
        return self.head

    def _check_complete(self) -> None:
        """Parse the head once it is in; finish when the body is complete."""
        raw = b"".join(self.reads)
        head = self._read_head(raw)
        if head is None:
            return
        if head.chunked:
            body_size = self.size - self.head_size
            if raw.endswith(_CHUNKED_END) or (body_size == 5 and raw.endswith(b"0\r\n\r\n")):
                self._finish()
        elif (length := head.content_length) is not None and self.size >= self.head_size + length:
            self._finish()
        # Otherwise the body runs until the server closes the connection.

    def response(self) -> Response:
        """The exchange's response, parsed from what arrived."""
        raw = b"".join(self.reads)
        head = self._read_head(raw)
        if head is None:
            raise WireError(f"no complete response head ({len(raw)} bytes arrived)")
        body = raw[self.head_size :]
        if head.chunked:
            chunks, complete = decode_chunked(body, self.head_size)
        elif head.content_length is not None:
            complete = len(body) >= head.content_length
            kept = min(len(body), head.content_length)
            chunks = [(self.head_size + kept, body[:kept])]
        else:
            complete = self.closed
            chunks = [(self.size, body)]
        pieces = []
        for end, payload in chunks:
            # The read that brought the chunk's last byte is when the chunk arrived.
            read = min(bisect.bisect_left(self.read_ends, end), len(self.read_times) - 1)
            pieces.append((self.read_times[read], payload))
        return Response(head, pieces, complete)


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
    origin = Origin.of(url)
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {target} HTTP/1.1", f"Host: {origin.host}:{origin.port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines += [f"Content-Length: {len(body)}", "", ""]
    request = "\r\n".join(lines).encode("latin-1") + body
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
            response.error = f"connection lost mid-response: {lost!r}" if lost else "incomplete"
        reusable = response.complete and response.head.keep_alive and not connection.closed
        return response
    finally:
        pool.release(origin, connection, reusable)
