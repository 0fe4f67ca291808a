"""An HTTP/1.1 server on a bare asyncio protocol: the machine gateway's listening side.

The gateway answers about 1,400 small requests a second from one event loop on a machine it
shares (docs/scale.md). aiohttp's server spent most of the gateway's loop on its own
machinery (its request and response objects, routing, writers); here a connection is one
``asyncio.Protocol`` with httptools (llhttp) parsing its requests, and an answer is written
in one ``transport.write``.

What it does for every request, before any handler sees it:

- reads the head and the whole body, within ``read_timeout`` from the request's first byte
  (else 408) and within ``max_body`` bytes (else 413), and answers ``Expect: 100-continue``;
- refuses what is not HTTP/1.x with a 400 and closes the connection;
- serves one request at a time a connection, in order (pipelined requests wait their turn,
  and the connection stops reading while more than a few wait);
- closes a connection idle for ``keepalive_timeout`` between requests, and after the answer
  when the request asked for it (``Connection: close``, or HTTP/1.0 without keep-alive);
- answers a handler that raised with a 500, never its traceback.

A handler gets a :class:`Request` and a :class:`Reply`, and answers through the reply: whole
(:meth:`Reply.send`) or streamed (:meth:`Reply.start`, :meth:`Reply.write`, :meth:`Reply.end`).
Errors go out in the control plane's shape, ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qs

import httptools

log = logging.getLogger("syshax.http1_server")

# Requests parsed ahead of the one being answered, before the connection stops reading.
MAX_WAITING = 4
# Answers with no body of their own (RFC 9110 6.4.1).
BODILESS = frozenset({204, 304})
# Chunked transfer coding's last chunk.
LAST_CHUNK = b"0\r\n\r\n"


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


_date: tuple[int, bytes] = (0, b"")


def http_date() -> bytes:
    """The ``Date`` field's value for now, made once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, email.utils.formatdate(now, usegmt=True).encode())
    return _date[1]


def error_body(code: str, message: str) -> bytes:
    """The control plane's error shape (``controlplane/core/api.py``)."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


@dataclass
class Request:
    """A whole request: its head and its body, read before any handler runs."""

    method: str
    target: str  # as sent: the path and the query, percent-encoded
    version: tuple[int, int]
    headers: list[tuple[str, str]]  # in arrival order, names as sent
    body: bytes
    remote: str
    keep_alive: bool
    _fields: dict[str, str] | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        """The path as sent (still percent-encoded), without the query."""
        return self.target.partition("?")[0]

    @property
    def query_string(self) -> str:
        return self.target.partition("?")[2]

    def query(self) -> dict[str, list[str]]:
        """Each query parameter to all its values, in order."""
        return parse_qs(self.query_string, keep_blank_values=True)

    def header(self, name: str, default: str = "") -> str:
        """A field's value by its lower-case name; a field sent on several lines is their
        values joined by ``, `` (RFC 9110 5.3)."""
        if self._fields is None:
            fields: dict[str, str] = {}
            for key, value in self.headers:
                key = key.lower()
                fields[key] = f"{fields[key]}, {value}" if key in fields else value
            self._fields = fields
        return self._fields.get(name, default)

    @property
    def content_length(self) -> int | None:
        value = self.header("content-length")
        return int(value) if value.isdigit() else None

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower-cased, without its parameters."""
        return self.header("content-type").partition(";")[0].strip().lower()


class Reply:
    """A request's answer on its connection: whole, or a head and then its body in parts."""

    __slots__ = ("_chunked", "_conn", "_head_only", "_old", "closes", "finished", "started")

    def __init__(self, conn: Connection, request: Request) -> None:
        self._conn = conn
        self._head_only = request.method == "HEAD"
        self._old = request.version < (1, 1)  # knows no chunked coding
        self._chunked = False
        # The connection closes after this answer (said in its head).
        self.closes = not request.keep_alive
        self.started = False
        self.finished = False

    def _head(self, status: int, headers: Iterable[tuple[str, str]], framing: str) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason(status)}\r\n".encode("latin-1")]
        dated = False
        for name, value in headers:
            dated = dated or name.lower() == "date"
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if not dated:
            lines.append(b"Date: " + http_date() + b"\r\n")
        lines.append(framing.encode("latin-1"))
        lines.append(b"Connection: close\r\n\r\n" if self.closes else b"\r\n")
        return b"".join(lines)

    def send(self, status: int, headers: Iterable[tuple[str, str]], body: bytes = b"") -> None:
        """The whole answer in one write. ``headers`` leave out ``Content-Length``, framing
        and ``Connection``, which this sets."""
        if self.started:
            raise RuntimeError("the answer was started already")
        self.started = self.finished = True
        bodiless = status in BODILESS or status < 200
        framing = "" if bodiless else f"Content-Length: {len(body)}\r\n"
        head = self._head(status, headers, framing)
        self._conn.write(head if bodiless or self._head_only else head + body)

    def send_json(self, status: int, body: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send(
            status,
            [("Content-Type", "application/json"), *headers],
            json.dumps(body, separators=(",", ":")).encode(),
        )

    def send_error(self, status: int, code: str, message: str) -> None:
        self.send(status, [("Content-Type", "application/json")], error_body(code, message))

    async def start(
        self, status: int, headers: Iterable[tuple[str, str]], length: int | None
    ) -> None:
        """The head of an answer whose body follows in :meth:`write`: ``length`` bytes, or
        chunked when the length is not known."""
        if self.started:
            raise RuntimeError("the answer was started already")
        self.started = True
        if status in BODILESS or status < 200 or self._head_only:
            framing = "" if length is None else f"Content-Length: {length}\r\n"
        elif length is not None:
            framing = f"Content-Length: {length}\r\n"
        elif self._old:
            framing, self.closes = "", True  # the body ends where the connection does
        else:
            self._chunked = True
            framing = "Transfer-Encoding: chunked\r\n"
        self._conn.write(self._head(status, headers, framing))
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        if not data or self._head_only:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._conn.write(data)
        await self._conn.drain()

    def end(self) -> None:
        if self._chunked and not self._head_only:
            self._conn.write(LAST_CHUNK)
        self.finished = True

    def abort(self) -> None:
        """Close the connection: an answer already started is seen cut off, never hung."""
        self._conn.close()


Handler = Callable[[Request, Reply], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    max_body: int  # bytes of a request's body
    read_timeout: float  # seconds from a request's first byte to its last
    keepalive_timeout: float = 75.0  # seconds a connection may wait idle between requests


class Connection(asyncio.Protocol):
    """One client connection: its parser, the requests it sent, and their answers in order."""

    def __init__(self, handler: Handler, limits: Limits, connections: set[Connection]) -> None:
        self.handler, self.limits, self.connections = handler, limits, connections
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.remote = ""
        self.waiting: list[Request] = []
        self.serving: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.closing = False
        self._writable: asyncio.Event | None = None
        # The request being read.
        self._reading = False
        self._url: list[bytes] = []
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._size = 0
        # Set once a request is refused: nothing more is read, and the refusal goes out
        # (after the answer under way, if any) before the connection closes.
        self._refused: tuple[int, str, str] | None = None

    # -- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._arm(self.limits.keepalive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.connections.discard(self)
        self._disarm()
        if self._writable is not None:
            self._writable.set()  # a writer waiting to drain finds the connection gone

    def pause_writing(self) -> None:
        self._writable = asyncio.Event()

    def resume_writing(self) -> None:
        if self._writable is not None:
            self._writable.set()
            self._writable = None

    async def drain(self) -> None:
        if self._writable is not None and not self.closing:
            await self._writable.wait()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(data)

    def close(self) -> None:
        self.closing = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    def idle(self) -> bool:
        """Between requests: nothing being read, answered or waiting."""
        return self.serving is None and not self.waiting and not self._reading

    def _arm(self, seconds: float) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self) -> None:
        self.timer = None
        if self._reading and self.serving is None and not self.waiting:
            limit = self.limits.read_timeout
            self._refuse(
                408, "request_timeout", f"the request did not arrive whole within {limit:g} s"
            )
        elif self.idle():
            self.close()

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer the request being read with an error, and close: what follows it on the
        connection cannot be found once its body was not read. An answer under way goes out
        first."""
        if self._refused is not None:
            return
        self._refused = (status, code, message)
        if self.transport is not None:
            self.transport.pause_reading()
        if self.serving is None:
            self._send_refusal()

    def _send_refusal(self) -> None:
        assert self._refused is not None
        status, code, message = self._refused
        body = error_body(code, message)
        head = (
            f"HTTP/1.1 {status} {reason(status)}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nDate: "
        ).encode("latin-1")
        self.write(head + http_date() + b"\r\nConnection: close\r\n\r\n" + body)
        self.close()

    def data_received(self, data: bytes) -> None:
        if self._refused is not None or self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # an Upgrade is not taken: the request is answered as any other
        except httptools.HttpParserError as exc:
            self._refuse(400, "bad_request", f"malformed HTTP request: {exc}")

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = [], [], [], 0
        self._reading = True
        if self.serving is None and not self.waiting:
            self._arm(self.limits.read_timeout)

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        length = next((v for k, v in self._headers if k.lower() == "content-length"), "")
        limit = self.limits.max_body
        if length.isdigit() and int(length) > limit:
            self._refuse(
                413,
                "payload_too_large",
                f"request body is {int(length)} bytes; the limit is {limit} bytes",
            )
            return
        expect = next((v for k, v in self._headers if k.lower() == "expect"), "")
        if expect.lower() == "100-continue" and self.parser.get_http_version() == "1.1":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._refused is not None:
            return
        self._size += len(body)
        if self._size > self.limits.max_body:
            limit = self.limits.max_body
            self._refuse(
                413, "payload_too_large", f"request body is over the limit of {limit} bytes"
            )
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._refused is not None:
            return
        major, _, minor = self.parser.get_http_version().partition(".")
        request = Request(
            method=self.parser.get_method().decode("latin-1"),
            target=b"".join(self._url).decode("latin-1"),
            version=(int(major or 1), int(minor or 1)),
            headers=self._headers,
            body=b"".join(self._body),
            remote=self.remote,
            keep_alive=bool(self.parser.should_keep_alive()),
        )
        self._url, self._headers, self._body, self._size = [], [], [], 0
        self._reading = False
        self.waiting.append(request)
        if len(self.waiting) > MAX_WAITING and self.transport is not None:
            self.transport.pause_reading()
        if self.serving is None:
            self._disarm()
            self.serving = asyncio.get_running_loop().create_task(self._serve())

    # -- answering --------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while self.waiting and not self.closing:
                request = self.waiting.pop(0)
                if self.transport is not None and len(self.waiting) == MAX_WAITING:
                    self.transport.resume_reading()
                reply = Reply(self, request)
                try:
                    await self.handler(request, reply)
                except Exception:
                    log.exception("%s %s failed", request.method, request.path)
                    if not reply.started:
                        reply.send_error(500, "server_error", "the gateway failed to answer")
                    else:
                        reply.abort()
                if not reply.finished:
                    reply.abort()  # a handler that left its answer unfinished
                if reply.closes:
                    self.close()
        finally:
            self.serving = None
        if self._refused is not None and not self.closing:
            self._send_refusal()
        if self.closing:
            return
        if self._reading:
            self._arm(self.limits.read_timeout)  # the next request is being read
        else:
            self._arm(self.limits.keepalive_timeout)


class Server:
    """Listens, and closes its connections on :meth:`close`: idle ones at once, the others
    once their answers are out (or ``grace`` seconds have passed)."""

    def __init__(self, handler: Handler, limits: Limits) -> None:
        self.handler, self.limits = handler, limits
        self.connections: set[Connection] = set()
        self.server: asyncio.Server | None = None

    async def listen(self, host: str, port: int, backlog: int = 100) -> None:
        self.server = await asyncio.get_running_loop().create_server(
            lambda: Connection(self.handler, self.limits, self.connections),
            host,
            port,
            backlog=backlog,
            reuse_address=True,
        )

    async def close(self, grace: float = 10.0) -> None:
        if self.server is not None:
            self.server.close()
        deadline = time.monotonic() + grace
        while self.connections and time.monotonic() < deadline:
            for conn in list(self.connections):
                if conn.idle():
                    conn.close()
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close()
        if self.server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
