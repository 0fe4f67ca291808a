"""The gunicorn worker ``syshax web`` serves the control plane with: no slow client holds a thread.

gunicorn's gthread worker hands a connection to a pool thread as soon as its socket turns
readable. The thread then blocks in ``recv()`` while the head arrives, and Django blocks it
again while the body arrives, for as long as the client cares to trickle them: 40 such clients
kept every thread of the control plane busy and ``/api/v1/health`` unanswered.

:class:`BufferedRequestWorker` reads each request in the worker's event loop instead, without
blocking, the way gthread already waits for the next request on a kept-alive connection. A
thread gets only a request whose head and body are both in memory. A request must be whole
within ``SYSHAX_WEB_READ_TIMEOUT`` seconds of the moment the worker starts waiting for it (its
connection accepted, or readable again after the last answer); otherwise the client gets a 408
and the connection is closed. A body over its limit gets a 413 before it is read, a head over
64 KiB a 431, and ``Transfer-Encoding`` a 411 (Django reads no chunked body). Connections
closed after an answer linger in the loop too, not in gunicorn's blocking close.

A body's limit is ``MAX_REQUEST_BODY_BYTES`` (2 MiB), except on the paths of
:func:`body_limits_by_path`, which the settings' ``BODY_LIMITS_BY_PATH`` is too: the Batch
API's upload (``POST /v1/files``, exactly that path) may carry ``BATCH_MAX_FILE_BYTES`` (50 MiB)
plus 1 MiB of multipart framing. Large uploads cost memory, bounded twice over. The bodies
still arriving at one worker share its buffer budget: twice the largest limit plus a head
(about 102 MiB by default, never under ``MIN_BUFFER_BUDGET``), so two whole uploads can
arrive at once and a request that would take the worker past it gets a 503 and is closed.
A whole request then stays in memory while a thread serves it, until Django has spooled the
file to a temporary file (past ``FILE_UPLOAD_MAX_MEMORY_SIZE``) and it is stored a chunk at a
time: at most one per thread. A worker of 4 threads thus holds at most about 102 + 4 x 51
MiB of bodies; lower ``BATCH_MAX_FILE_BYTES`` or the threads where that is too much.

Cleartext HTTP/1.1 only: TLS ends in the proxy in front (docs/deployment.md). Django-free.
The worker leans on gthread's internals, so pyproject.toml pins gunicorn to one major version.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

from common.body_limits import DEFAULT_FILE_LIMIT, body_limits_by_path

READ_TIMEOUT_ENV = "SYSHAX_WEB_READ_TIMEOUT"
BODY_LIMIT_ENV = "MAX_REQUEST_BODY_BYTES"
FILE_LIMIT_ENV = "BATCH_MAX_FILE_BYTES"
DEFAULT_READ_TIMEOUT = 10.0
DEFAULT_BODY_LIMIT = 2 * 1024 * 1024  # the control plane's own default (settings/base.py)
MAX_HEAD_BYTES = 64 * 1024
# All the partly read requests of one worker hold at most this much memory together.
MIN_BUFFER_BUDGET = 64 * 1024 * 1024
RECV_BYTES = 64 * 1024
# A closing connection is drained for this long (gunicorn's close_graceful does the same, but
# blocking), so the kernel does not answer the client's last bytes with a reset.
LINGER_SECONDS = 2.0
LINGER_MAX_BYTES = 64 * 1024
# A stopping worker gives a request still arriving this long (gthread's keep-alive linger).
STOP_GRACE_SECONDS = 2.0

_END_OF_HEAD = re.compile(rb"\n\r?\n")
_ERROR_CODES = {
    400: "bad_request",
    408: "request_timeout",
    411: "length_required",
    413: "payload_too_large",
    431: "headers_too_large",
    503: "busy",
}


@dataclass(frozen=True)
class ReadLimits:
    timeout: float = DEFAULT_READ_TIMEOUT
    max_body: int = DEFAULT_BODY_LIMIT
    max_file: int = DEFAULT_FILE_LIMIT

    @property
    def by_path(self) -> dict[bytes, int]:
        return {p.encode(): n for p, n in body_limits_by_path(self.max_file).items()}

    @property
    def largest_body(self) -> int:
        return max(self.max_body, *self.by_path.values())


def limits_from_env(env: Mapping[str, str]) -> ReadLimits:
    """The worker's limits from the environment; a bad value raises naming its variable."""
    timeout, max_body, max_file = DEFAULT_READ_TIMEOUT, DEFAULT_BODY_LIMIT, DEFAULT_FILE_LIMIT
    raw = env.get(READ_TIMEOUT_ENV, "")
    if raw:
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{READ_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        if not 0.5 <= timeout <= 3600:
            raise ValueError(f"{READ_TIMEOUT_ENV}={raw!r} must be between 0.5 and 3600 seconds")
    raw = env.get(BODY_LIMIT_ENV, "")
    if raw:
        if not raw.isdigit() or int(raw) < 1024:
            raise ValueError(f"{BODY_LIMIT_ENV}={raw!r} must be a whole number of bytes >= 1024")
        max_body = int(raw)
    raw = env.get(FILE_LIMIT_ENV, "")
    if raw:
        if not raw.isdigit() or int(raw) < 1024:
            raise ValueError(f"{FILE_LIMIT_ENV}={raw!r} must be a whole number of bytes >= 1024")
        max_file = int(raw)
    return ReadLimits(timeout, max_body, max_file)


@dataclass(frozen=True)
class Extent:
    """What the bytes at the start of a connection's buffer say about the request in them."""

    total: int | None = None  # its length, head and body, once the head is whole
    refuse: int = 0  # or the status to answer instead of serving it
    reason: str = ""
    expects_continue: bool = False  # the head asks for "100 Continue" before the body


def request_extent(
    buf: bytes | bytearray,
    *,
    max_head: int,
    max_body: int,
    by_path: Mapping[bytes, int] | None = None,
) -> Extent:
    """Where the first request in ``buf`` ends, from its head alone; no I/O. Its body may be
    ``max_body`` bytes, or ``by_path``'s limit for its path (exactly, without the query).

    This only decides when gunicorn's own parser gets the bytes, so a head it would refuse
    (a bare LF, a bad header) is handed over as soon as it is whole and refused there.
    """
    start = 0
    while start < len(buf) and buf[start] in b"\r\n":
        start += 1  # RFC 9112 2.2: empty lines before a request line
    end = _END_OF_HEAD.search(buf, start)
    if end is None or end.end() > max_head:
        if end is None and len(buf) <= max_head:
            return Extent()
        return Extent(refuse=431, reason=f"the request head is over {max_head} bytes")
    head_end = end.end()
    head = bytes(buf[start:head_end])
    if head.count(b"\n") != head.count(b"\r\n"):
        return Extent(total=head_end)
    if by_path:
        max_body = body_limit(head, max_body, by_path)
    lengths: list[bytes] = []
    expects_continue = False
    for line in head.split(b"\r\n")[1:]:
        if line[:1] in (b" ", b"\t"):
            continue  # an obs-fold continuation line, which gunicorn refuses
        name, colon, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if not colon:
            continue
        if name == b"transfer-encoding":
            return Extent(refuse=411, reason="send the body with a Content-Length")
        if name == b"content-length":
            lengths.append(value)
        elif name == b"expect":
            expects_continue = value.lower() == b"100-continue"
    if not lengths:
        return Extent(total=head_end)
    if len(lengths) > 1 or not lengths[0].isdigit():
        return Extent(refuse=400, reason="Content-Length must be given once, as a number")
    # int() refuses numbers of over 4300 digits; anything over 19 is over the limit anyway.
    length = int(lengths[0]) if len(lengths[0]) <= 19 else max_body + 1
    if length > max_body:
        return Extent(
            refuse=413,
            reason=f"request body is {length} bytes; the limit is {max_body} bytes",
        )
    return Extent(total=head_end + length, expects_continue=expects_continue)


def body_limit(head: bytes, max_body: int, by_path: Mapping[bytes, int]) -> int:
    """The body limit of the request whose head is ``head``: its path's own, else
    ``max_body``. A target in another form than a plain path gets ``max_body``."""
    request_line = head.split(b"\r\n", 1)[0].split(b" ")
    if len(request_line) != 3:
        return max_body
    path = request_line[1].split(b"?", 1)[0]
    return by_path.get(path, max_body)


def error_answer(status: int, reason: str) -> bytes:
    """A whole HTTP/1.1 answer in the API's error shape, closing the connection."""
    body = json.dumps({"error": {"code": _ERROR_CODES[status], "message": reason}}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class ReadAheadOnly:
    """The socket as the request parser sees it once the loop has read a request ahead: it
    never waits. Needing a byte that has not come means the parser and :func:`request_extent`
    disagree about where the request ends; failing the request beats holding the thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv(self, size: int) -> bytes:
        try:
            return self.sock.recv(size, socket.MSG_DONTWAIT)
        except BlockingIOError:
            raise TimeoutError("the request ran past the bytes read ahead of it") from None


@dataclass(eq=False)
class _Reading:
    conn: Any  # gthread's TConn
    buf: bytearray
    deadline: float
    total: int | None = None


class BufferedRequestWorker(ThreadWorker):  # type: ignore[misc]  # gunicorn has no types
    """gthread with the request read in the event loop (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits_from_env(os.environ)
        self.by_path = self.limits.by_path
        # Two of the largest requests can arrive at once (module docstring).
        self.buffer_budget = max(MIN_BUFFER_BUDGET, 2 * (self.limits.largest_body + MAX_HEAD_BYTES))
        self.buffered = 0
        # Both dicts are in the order their deadlines come: each deadline is "now" plus a
        # fixed span, and an entry that comes back is added again at the end.
        self.reading: dict[Any, _Reading] = {}
        self.lingering: dict[socket.socket, float] = {}

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        super().check_config(cfg, log)
        limits_from_env(os.environ)
        if cfg.is_ssl or "h2" in getattr(cfg, "http_protocols", ()):
            # Both would read the socket while setting the connection up, in the loop.
            raise RuntimeError(
                "controlplane.webworker serves cleartext HTTP/1.1 only; end TLS in a proxy in front"
            )

    # -- every connection that may carry a request comes through enqueue_req ---------------

    def enqueue_req(self, conn: Any) -> None:
        """Wait for the connection's next whole request in the loop, not in a thread. gthread
        calls this for a new connection, a kept-alive one that turned readable, and one whose
        last request read part of the next one ahead."""
        leftover = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        conn.sock.setblocking(False)
        reading = _Reading(conn, bytearray(leftover), time.monotonic() + self.limits.timeout)
        self.buffered += len(leftover)
        self.reading[conn] = reading
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_readable, reading))
        if leftover:
            self.advance(reading)

    def on_readable(self, reading: _Reading, _fileobj: object) -> None:
        try:
            data = reading.conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self.forget(reading)
            self.nr_conns -= 1
            util.close(reading.conn.sock)
            return
        reading.buf += data
        self.buffered += len(data)
        if self.buffered > self.buffer_budget:
            self.refuse(reading, 503, "too many requests are arriving at once; try again")
            return
        self.advance(reading)

    def advance(self, reading: _Reading) -> None:
        try:
            self.hand_over_when_whole(reading)
        except Exception:
            # A fault here would end the whole worker loop, with every connection it holds.
            self.log.exception("reading a request ahead of the threads")
            if reading.conn in self.reading:
                self.forget(reading)
                self.nr_conns -= 1
                util.close(reading.conn.sock)

    def hand_over_when_whole(self, reading: _Reading) -> None:
        if reading.total is None:
            extent = request_extent(
                reading.buf,
                max_head=MAX_HEAD_BYTES,
                max_body=self.limits.max_body,
                by_path=self.by_path,
            )
            if extent.refuse:
                self.refuse(reading, extent.refuse, extent.reason)
                return
            if extent.total is None:
                return
            reading.total = extent.total
            if extent.expects_continue and len(reading.buf) < extent.total:
                self.send_now(reading.conn.sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        if len(reading.buf) >= reading.total:
            self.hand_over(reading)

    def hand_over(self, reading: _Reading) -> None:
        """Give a thread the whole request: gthread's parser finds it in its read buffer."""
        conn = reading.conn
        conn.init()  # the HTTP/1.1 parser; no I/O in cleartext (check_config)
        unreader = conn.parser.unreader
        if not isinstance(unreader.sock, ReadAheadOnly):
            unreader.sock = ReadAheadOnly(conn.sock)
        unreader.unread(bytes(reading.buf))
        self.forget(reading)
        conn.data_ready = True  # gthread's own wait for a first byte (in the thread) is over
        super().enqueue_req(conn)

    def handle_request(self, req: Any, conn: Any) -> bool:
        # The body is here already: gunicorn's "100 Continue" would only follow it (RFC 9110
        # 10.1.1 lets a server that has the content leave it out).
        if getattr(req, "_expected_100_continue", False):
            req._expected_100_continue = False
        # A client that stops reading the answer holds this thread in a write for at most
        # this long.
        conn.sock.settimeout(self.limits.timeout)
        return bool(super().handle_request(req, conn))

    def finish_request(self, conn: Any, fs: Any) -> None:
        keepalive = not fs.cancelled() and fs.exception() is None and fs.result() is True
        if keepalive:
            super().finish_request(conn, fs)  # back to the poller, or to enqueue_req
            return
        self.nr_conns -= 1
        self.close_lingering(conn.sock)

    # -- answering and closing without blocking the loop --------------------------------------

    def refuse(self, reading: _Reading, status: int, reason: str) -> None:
        self.forget(reading)
        self.nr_conns -= 1
        peer = reading.conn.client
        self.log.info("%s: %s %s; connection closed", _peer(peer), status, reason)
        self.send_now(reading.conn.sock, error_answer(status, reason))
        self.close_lingering(reading.conn.sock)

    def send_now(self, sock: socket.socket, data: bytes) -> None:
        """Send what the socket takes now; a small answer fits in its buffer."""
        with contextlib.suppress(OSError):
            sock.send(data, socket.MSG_DONTWAIT)

    def close_lingering(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            util.close(sock)
            return
        try:
            self.poller.register(sock, selectors.EVENT_READ, self.drain)
        except (KeyError, ValueError, OSError):
            util.close(sock)
            return
        self.lingering[sock] = time.monotonic() + LINGER_SECONDS

    def drain(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(LINGER_MAX_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data or len(data) >= LINGER_MAX_BYTES:
            self.close_now(sock)

    def close_now(self, sock: socket.socket) -> None:
        self.lingering.pop(sock, None)
        self.unregister(sock)
        util.close(sock)

    def forget(self, reading: _Reading) -> None:
        del self.reading[reading.conn]
        self.buffered -= len(reading.buf)
        self.unregister(reading.conn.sock)

    def unregister(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.poller.unregister(sock)

    # -- deadlines: gthread's loop calls this about once a second -----------------------------

    def murder_keepalived(self, force: bool = False) -> None:
        super().murder_keepalived(force)
        now = time.monotonic()
        while self.reading:
            reading = next(iter(self.reading.values()))
            if reading.deadline > now and not force:
                break
            if force or not reading.buf.strip(b"\r\n"):
                # Shutting down, or a connection that never sent anything: nothing to answer.
                self.forget(reading)
                self.nr_conns -= 1
                util.close(reading.conn.sock)
            elif not self.alive:
                self.refuse(reading, 503, "the server is stopping; send the request again")
            else:
                limit = self.limits.timeout
                self.refuse(reading, 408, f"the request did not arrive whole within {limit:g} s")
        if not self.alive:
            # A stopping worker waits for nr_conns to reach 0: idle connections go now, and a
            # request still arriving has STOP_GRACE_SECONDS left (capping every deadline at
            # the same time keeps their order).
            cap = now + STOP_GRACE_SECONDS
            for reading in list(self.reading.values()):
                if not reading.buf:
                    self.forget(reading)
                    self.nr_conns -= 1
                    util.close(reading.conn.sock)
                else:
                    reading.deadline = min(reading.deadline, cap)
        while self.lingering:
            sock, deadline = next(iter(self.lingering.items()))
            if deadline > now and not force:
                break
            self.close_now(sock)


def _peer(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
