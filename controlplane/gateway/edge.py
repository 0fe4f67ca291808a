"""The gateway's listening side: uvicorn's httptools protocol, with the limits it leaves out.

uvicorn parses and frames HTTP/1.1 (keep-alive, pipelining, flow control, ``100 Continue``);
:class:`EdgeProtocol` adds, before the gateway sees a request:

- a head of at most ``max_head`` bytes and ``max_fields`` fields, else 431: httptools keeps
  a field however long it is, and takes any number of them;
- a body of at most ``max_body`` bytes, else 413 (by its ``Content-Length`` before any of it
  is read, or as a chunked body passes the limit);
- only an origin-form target (``/path?query``): ``CONNECT`` and the absolute, asterisk and
  authority forms get a 400, since the gateway serves one site and proxies to one upstream;
- ``read_timeout`` seconds from a request's first byte to its last, else 408, and
  ``idle_timeout`` seconds between requests, a new connection's first wait included (uvicorn
  waits for a first request for ever);
- at most ``max_connections`` open: one more closes the connection idle the longest, or the
  new one when none is idle.

Each refusal, timeout and eviction is counted (:class:`EdgeCounts`, in the gateway's report).
A refusal goes out in the control plane's error shape after any answer under way, and the
connection closes: what follows a refused request on it cannot be found.

:func:`asgi_app` turns the gateway's handler, ``handler(request, reply)``, into the ASGI
application uvicorn runs: the body read whole, then a :class:`Request` and a :class:`Reply`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("controlplane.gateway")

# Bytes fed to the parser at a time. A head is measured in these steps, so a head of up to
# ``max_head - FEED_BYTES`` always passes and one over ``max_head + FEED_BYTES`` never does.
FEED_BYTES = 8 * 1024
# Answers with no body of their own (RFC 9110 6.4.1).
BODILESS = frozenset({204, 304})
# File descriptors kept for what is not a client: upstream connections, the database, logs.
RESERVED_FILES = 256
# A refused connection is read (and what comes dropped) this long, or this much, before it
# closes: closed with bytes unread, the kernel resets it, and the client may lose the answer.
LINGER_SECONDS = 2.0
LINGER_BYTES = 256 * 1024


@dataclass(frozen=True)
class EdgeLimits:
    max_body: int  # bytes of a request's body
    read_timeout: float  # seconds from a request's first byte to its last
    idle_timeout: float = 20.0  # seconds a connection may wait for its next request
    max_head: int = 64 * 1024  # bytes of a request's head (its line and fields)
    max_fields: int = 100  # fields in a request's head
    max_connections: int = 16_384  # open client connections
    # Larger bodies allowed on these exact paths (the Batch API's file uploads, which routers
    # forward here): (path, bytes).
    body_limits_by_path: tuple[tuple[bytes, int], ...] = ()

    def body_limit(self, target: bytes) -> int:
        """The body limit of a request for ``target`` (its path, before any query)."""
        path = target.split(b"?", 1)[0]
        for prefix, limit in self.body_limits_by_path:
            if path == prefix:
                return limit
        return self.max_body


@dataclass
class EdgeCounts:
    """Connections the edge closed or refused, and requests it refused, since it started."""

    idle_closed: int = 0  # idle past idle_timeout
    slow_closed: int = 0  # a request not whole within read_timeout (408)
    evicted: int = 0  # idle, closed for a new connection over max_connections
    turned_away: int = 0  # new, closed over max_connections with none idle
    head_refused: int = 0  # 431
    body_refused: int = 0  # 413
    target_refused: int = 0  # 400: CONNECT, or not a path
    malformed: int = 0  # 400: not HTTP/1.x

    def __str__(self) -> str:
        return (
            f"connections closed idle {self.idle_closed}, slow {self.slow_closed}, evicted"
            f" {self.evicted}, turned away {self.turned_away}; refused heads {self.head_refused},"
            f" bodies {self.body_refused}, targets {self.target_refused}, malformed"
            f" {self.malformed}"
        )


@dataclass
class Edge:
    """What the connections share: the limits, the counts and the idle connections, oldest
    first."""

    limits: EdgeLimits
    counts: EdgeCounts = field(default_factory=EdgeCounts)
    idle: dict[EdgeProtocol, None] = field(default_factory=dict)


def error_body(code: str, message: str) -> bytes:
    """The control plane's error shape (``controlplane/core/api.py``)."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a refused request."""


class EdgeProtocol(HttpToolsProtocol):
    """One client connection (see the module's docstring for what it adds to uvicorn's).

    uvicorn's parser callbacks run for every request; the checks here sit in the few it
    already makes (the head's end, the message's end, a piece of body), so a request pays for
    them with a handful of comparisons."""

    def __init__(self, *args: Any, edge: Edge, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.edge = edge
        self.limits = edge.limits
        self._head_open = True  # between requests, or reading a head
        self._head_bytes = 0
        self._body_bytes = 0
        self._max_body = self.limits.max_body  # the request being read's body limit
        self._reading: asyncio.TimerHandle | None = None
        self._refused = False
        self._refusal: bytes | None = None  # to send once the answer under way is out
        self._lingering: asyncio.TimerHandle | None = None
        self._lingered = 0

    # -- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(cast(asyncio.Transport, transport))
        if len(self.connections) > self.limits.max_connections:
            if self.edge.idle:
                oldest = next(iter(self.edge.idle))
                del self.edge.idle[oldest]
                self.edge.counts.evicted += 1
                oldest.transport.close()
            else:
                self.edge.counts.turned_away += 1
                self.transport.close()
                return
        # uvicorn arms its keep-alive timer only once an answer is out.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.limits.idle_timeout, self.timeout_keep_alive_handler
        )
        self.edge.idle[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.edge.idle.pop(self, None)
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.edge.counts.idle_closed += 1
        super().timeout_keep_alive_handler()

    def _read_timed_out(self) -> None:
        self._reading = None
        if self._refused or self.transport.is_closing():
            return
        self.edge.counts.slow_closed += 1
        limit = self.limits.read_timeout
        self._refuse(
            408,
            "request_timeout",
            f"the request did not arrive whole within {limit:g} s",
            own=None if self._head_open else self.cycle,
        )

    # -- reading ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused or self.parser is None:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.close()
            return
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
            self.edge.idle.pop(self, None)
        if self._head_open and self._reading is None:
            self._reading = self.loop.call_later(self.limits.read_timeout, self._read_timed_out)
        if len(data) <= FEED_BYTES:
            self._feed(data)
            return
        view = memoryview(data)
        for start in range(0, len(data), FEED_BYTES):
            if not self._feed(view[start : start + FEED_BYTES]):
                return

    def _feed(self, data: bytes | memoryview) -> bool:
        """Parse ``data``; False once the connection reads no more."""
        if self._head_open:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head:
                self.edge.counts.head_refused += 1
                limit = self.limits.max_head
                self._refuse(431, "headers_too_large", f"the request head is over {limit} bytes")
                return False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # CONNECT was refused with its head. Any other Upgrade is answered as a plain
            # request; the parser reads nothing after it, so its connection ends with it.
            if self.cycle is not None:
                self.cycle.keep_alive = False
            self.flow.pause_reading()
            return False
        except httptools.HttpParserError as exc:
            if not self._refused:
                self.edge.counts.malformed += 1
                self._refuse(400, "bad_request", f"malformed HTTP request: {exc}")
            return False
        # Fields are counted between pieces, not one by one (a call more each): a piece holds
        # a few thousand at most, and the head's size bounds them all.
        if self._head_open and self.headers and len(self.headers) > self.limits.max_fields:
            self._refuse_fields()
            return False
        return not self._refused

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._head_bytes = self._body_bytes = 0
        if len(self.headers) > self.limits.max_fields:
            self._refuse_fields()
            raise _Refused
        if self.parser.get_method() == b"CONNECT" or self.url[:1] != b"/":
            self.edge.counts.target_refused += 1
            self._refuse(400, "bad_request", "the request target must be a path (origin-form)")
            raise _Refused
        self._max_body = self.limits.body_limit(self.url)
        for name, value in self.headers:
            if name == b"content-length":
                if len(value) > 18 or int(value) > self._max_body:
                    self._refuse_body()
                    raise _Refused
                break
        self.scope["syshax.connection"] = self  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._max_body:  # a chunked body; a sized one was checked
            self._refuse_body(own=self.cycle)
            raise _Refused
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        self._head_open = True
        self._head_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._refusal is not None:
            self._send_refusal()
            return
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:
            self.edge.idle[self] = None

    # -- refusing ---------------------------------------------------------------------------

    def _refuse_fields(self) -> None:
        self.edge.counts.head_refused += 1
        limit = self.limits.max_fields
        self._refuse(431, "headers_too_large", f"the request has over {limit} header fields")

    def _refuse_body(self, own: Any = None) -> None:
        self.edge.counts.body_refused += 1
        limit = self._max_body
        self._refuse(413, "payload_too_large", f"the request body is over {limit} bytes", own=own)

    def _refuse(self, status: int, code: str, message: str, own: Any = None) -> None:
        """Answer the request being read with an error and close the connection, after the
        answer under way to an earlier request, if any. ``own`` is the refused request's
        cycle once uvicorn made one (its head was whole)."""
        if self._refused:
            return
        self._refused = True
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        self.flow.pause_reading()
        body = error_body(code, message)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body)
        )
        self._refusal = b"".join(head) + body
        if own is not None:
            # Its application, if started, waits for the rest of the body: it finds the
            # client gone, and answers nothing.
            own.disconnected = True
            own.message_event.set()
            if own.response_started:
                self._refusal = None
                self.transport.close()
                return
            waits = bool(self.pipeline)  # queued behind an earlier request's answer
        else:
            waits = self.cycle is not None and not self.cycle.response_complete
        if not waits:
            self._send_refusal()

    def _send_refusal(self) -> None:
        refusal, self._refusal = self._refusal, None
        if self.transport.is_closing():
            return
        if refusal is not None:
            self.transport.write(refusal)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_SECONDS, self.transport.close)
        self.flow.resume_reading()


# --- the application ------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    """A whole request: its head and its body, read before the handler runs."""

    method: str
    path: str  # as sent: still percent-encoded, without the query
    query_string: str
    headers: list[tuple[str, str]]  # names lower-case, in arrival order
    body: bytes
    remote: str
    _fields: dict[str, str] | None = None

    @property
    def target(self) -> str:
        """The path and the query, as sent."""
        return f"{self.path}?{self.query_string}" if self.query_string else self.path

    def query(self) -> dict[str, list[str]]:
        """Each query parameter to all its values, in order."""
        return parse_qs(self.query_string, keep_blank_values=True)

    def header(self, name: str, default: str = "") -> str:
        """A field's value by its lower-case name; a field sent on several lines is their
        values joined by ``, `` (RFC 9110 5.3)."""
        if self._fields is None:
            lines: dict[str, list[str]] = {}
            for key, value in self.headers:
                lines.setdefault(key, []).append(value)
            self._fields = {key: ", ".join(values) for key, values in lines.items()}
        return self._fields.get(name, default)

    @property
    def content_length(self) -> int | None:
        value = self.header("content-length")
        return int(value) if value.isdigit() else None

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower-cased, without its parameters."""
        return self.header("content-type").partition(";")[0].strip().lower()


Send = Callable[[dict[str, Any]], Awaitable[None]]


def _encoded(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]


class Reply:
    """A request's answer: whole (:meth:`send`), or a head and then its body in parts
    (:meth:`start`, :meth:`write`, :meth:`end`). ``headers`` leave out ``Content-Length``,
    framing and ``Connection``."""

    __slots__ = ("_connection", "_send", "finished", "started")

    def __init__(self, send: Send, connection: EdgeProtocol | None) -> None:
        self._send = send
        self._connection = connection
        self.started = False
        self.finished = False

    async def send(
        self, status: int, headers: Iterable[tuple[str, str]], body: bytes = b""
    ) -> None:
        await self.start(status, headers, None if status in BODILESS else len(body))
        self.finished = True
        await self._send({"type": "http.response.body", "body": body})

    async def start(
        self, status: int, headers: Iterable[tuple[str, str]], length: int | None
    ) -> None:
        """The head of an answer whose body follows: ``length`` bytes, or chunked when the
        length is not known."""
        if self.started:
            raise RuntimeError("the answer was started already")
        self.started = True
        fields = _encoded(headers)
        if length is not None:
            fields.append((b"content-length", b"%d" % length))
        await self._send({"type": "http.response.start", "status": status, "headers": fields})

    async def write(self, data: bytes) -> None:
        if data:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": b""})

    def abort(self) -> None:
        """Close the connection: an answer already started is seen cut off, never hung."""
        self.finished = True
        if self._connection is not None:
            self._connection.transport.close()


Handler = Callable[[Request, Reply], Awaitable[None]]


def asgi_app(handler: Handler) -> Callable[..., Awaitable[None]]:
    """The ASGI application that reads each request whole and hands it to ``handler``."""

    async def app(scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            return
        parts = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        client = scope.get("client")
        request = Request(
            method=scope["method"],
            path=scope["raw_path"].decode("latin-1"),
            query_string=scope["query_string"].decode("latin-1"),
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]],
            body=parts[0] if len(parts) == 1 else b"".join(parts),
            remote=str(client[0]) if client else "",
        )
        reply = Reply(send, scope.get("syshax.connection"))
        try:
            await handler(request, reply)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            if reply.started:
                reply.abort()
                return
            body = error_body("server_error", "the gateway failed to answer")
            await reply.send(500, [("Content-Type", "application/json")], body)
        if not reply.finished:
            reply.abort()  # a handler that left its answer unfinished

    return app


# --- the server -----------------------------------------------------------------------------


def connection_cap(wanted: int) -> int:
    """At most ``wanted`` client connections, within the process's open-file limit (raised to
    its hard limit first), less what the gateway needs besides: past it, accept() fails and
    the whole listener stalls, not one client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = wanted + RESERVED_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - RESERVED_FILES))


class Listener:
    """uvicorn serving ``handler`` on ``host:port`` with the edge's limits."""

    def __init__(self, handler: Handler, edge: Edge, *, backlog: int, grace: float) -> None:
        self.edge = edge
        self.backlog, self.grace = backlog, grace
        self.app = asgi_app(handler)
        self.server: uvicorn.Server | None = None
        self.serving: asyncio.Task[None] | None = None

    async def listen(self, host: str, port: int) -> None:
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            http=functools.partial(EdgeProtocol, edge=self.edge),  # type: ignore[arg-type]
            ws="none",
            lifespan="off",
            interface="asgi3",
            log_config=None,
            access_log=False,
            proxy_headers=False,  # X-Forwarded-For is the proxy's to add to, not to trust
            server_header=False,
            backlog=self.backlog,
            timeout_keep_alive=self.edge.limits.idle_timeout,  # type: ignore[arg-type]
            timeout_graceful_shutdown=self.grace,  # type: ignore[arg-type]
        )
        self.server = uvicorn.Server(config)
        self.serving = asyncio.create_task(self.server.serve(), name="gateway-http")
        while not self.server.started:
            if self.serving.done():
                self.serving.result()
                raise RuntimeError(f"the gateway could not listen on {host}:{port}")
            await asyncio.sleep(0.01)

    @property
    def open_connections(self) -> int:
        return len(self.server.server_state.connections) if self.server else 0

    async def close(self) -> None:
        """Stop listening, close idle connections, let the answers under way go out (at most
        ``grace`` seconds)."""
        if self.server is None or self.serving is None:
            return
        self.server.should_exit = True
        await self.serving
