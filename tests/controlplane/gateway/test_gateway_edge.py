"""The gateway's listening side under hostile clients, over raw sockets: what reaches the
control plane (a recording stand-in here), what is refused, and what is closed.

Each test is an attack found against the gateway's earlier HTTP server (docs/security.md):
a CONNECT that made the proxy call any host and port, heads of any size and any number of
fields, idle connections held 75 s with no cap on their number, hop-by-hop fields passed on.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from yarl import URL

from controlplane.gateway.edge import Request
from controlplane.gateway.upstream import upstream_base, upstream_url
from tests.support.gateway import Running, serving_gateway

pytestmark = pytest.mark.django_db(transaction=True)


# --- a recording control plane, and a gateway in front of it --------------------------------


@dataclass
class Upstream:
    """A stand-in control plane: answers every request 200, and keeps each one's head."""

    url: str
    heads: list[dict[str, str]] = field(default_factory=list)
    reply_fields: list[tuple[str, str]] = field(default_factory=list)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    recorded = Upstream("")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            recorded.heads.append({k.lower(): v for k, v in self.headers.items()})
            body = b'{"status":"ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in recorded.reply_fields:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_OPTIONS = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    recorded.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield recorded
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def start_gateway(upstream: Upstream) -> Iterator[Callable[..., Running]]:
    """Start a gateway in front of ``upstream`` on its own loop thread, with ``options``."""
    with ExitStack() as running:

        def start(**options: Any) -> Running:
            return running.enter_context(
                serving_gateway(upstream.url, snapshot=False, credential_ttl=0.0, **options)
            )

        yield start


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer read off ``sock``: its status, its fields and its body (by its length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    length = int(fields.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside the body"
        rest += chunk
    return int(lines[0].split()[1]), fields, rest[:length]


def _ask(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with _connect(port) as sock:
        sock.sendall(raw)
        return _answer(sock)


def _closed(sock: socket.socket, within: float) -> float | None:
    """Seconds until the gateway closed ``sock`` (reading nothing else), or None."""
    started = time.monotonic()
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


GET_HEALTH = b"GET /api/v1/health HTTP/1.1\r\nHost: gw\r\n\r\n"


# --- request targets: one upstream, reached by path only ------------------------------------


@pytest.fixture
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A port anything may try to reach, and what each connection to it sent."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    received: list[bytes] = []
    stopping = threading.Event()

    def accept() -> None:
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(1)
            try:
                received.append(conn.recv(65536))
            except OSError:
                received.append(b"")
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], received
    finally:
        stopping.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize(
    "request_line",
    [
        "CONNECT x@127.0.0.1:{port} HTTP/1.1",  # the SSRF: the text before @ became a user
        "CONNECT 127.0.0.1:{port} HTTP/1.1",  # authority-form
        "GET http://127.0.0.1:{port}/api/v1/health HTTP/1.1",  # absolute-form
        "OPTIONS * HTTP/1.1",  # asterisk-form
    ],
)
def test_a_target_that_is_not_a_path_is_refused_and_reaches_no_one(
    start_gateway: Callable[..., Running],
    upstream: Upstream,
    listener: tuple[int, list[bytes]],
    request_line: str,
) -> None:
    port, received = listener
    gw = start_gateway()
    line = request_line.format(port=port)
    status, _, body = _ask(gw.port, f"{line}\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_request"
    time.sleep(0.3)
    assert received == [], "the gateway connected to the attacker's host and port"
    assert upstream.heads == [], "nor did it hand the request to the control plane"
    assert gw.gateway.edge.counts.target_refused == 1


def test_the_upstream_url_takes_only_the_path_and_query_from_the_request() -> None:
    base = URL("http://127.0.0.1:8001")
    for target in ("//evil.example:1/x", "/@evil.example:2/", "/a%2F..%2F@b:3/?q=@c:4"):
        path, _, query = target.partition("?")
        request = Request("GET", path, query, [], b"", "127.0.0.1")
        url = upstream_url(base, request)
        assert (url.scheme, url.host, url.port, url.user) == ("http", "127.0.0.1", 8001, None)
        assert url.raw_path == path and url.raw_query_string == query


# --- heads and bodies -----------------------------------------------------------------------


def test_a_huge_head_is_refused_at_once_while_other_clients_are_served(
    start_gateway: Callable[..., Running],
) -> None:
    """A 1.4 MB head of repeated fields: refused with a 431 once past the limit, without
    stalling the loop; another client's request meanwhile is answered at once."""
    gw = start_gateway()
    line = b"X-Repeated: " + b"a" * 56 + b"\r\n"
    head = b"GET /api/v1/health HTTP/1.1\r\nHost: gw\r\n" + line * (1_400_000 // len(line))
    attacker = _connect(gw.port)

    def send() -> None:
        with contextlib.suppress(OSError):  # the gateway stops reading, and closes
            attacker.sendall(head + b"\r\n")

    started = time.monotonic()
    threading.Thread(target=send, daemon=True).start()
    status, _, body = _answer(attacker)
    refused_in = time.monotonic() - started
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    assert refused_in < 1.0
    asked = time.monotonic()
    assert _ask(gw.port, GET_HEALTH)[0] == 200
    assert time.monotonic() - asked < 0.5
    attacker.close()
    assert gw.gateway.edge.counts.head_refused == 1


def test_a_head_of_many_fields_is_refused(start_gateway: Callable[..., Running]) -> None:
    """Within the size limit, but over 100 fields (the earlier server joined a repeated
    field anew for every copy of it)."""
    gw = start_gateway()
    fields = b"X-A: 1\r\n" * 5000
    status, _, body = _ask(
        gw.port, b"GET /api/v1/health HTTP/1.1\r\nHost: gw\r\n" + fields + b"\r\n"
    )
    assert status == 431 and "100 header fields" in json.loads(body)["error"]["message"]
    # Within it, passed on (the stand-in control plane takes 100 fields, a few of them the
    # gateway's own).
    just_under = b"X-A: 1\r\n" * 90
    assert (
        _ask(gw.port, b"GET /api/v1/health HTTP/1.1\r\nHost: gw\r\n" + just_under + b"\r\n")[0]
        == 200
    )


def test_a_body_over_the_limit_is_refused_counted_and_its_connection_closed(
    start_gateway: Callable[..., Running], upstream: Upstream, settings: Any
) -> None:
    settings.MAX_REQUEST_BODY_BYTES = 4096
    gw = start_gateway()
    with _connect(gw.port) as sock:
        # By its length, before any of it is sent (no 100 Continue).
        sock.sendall(
            b"POST /api/v1/x HTTP/1.1\r\nHost: gw\r\nContent-Length: 4097\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        status, fields, body = _answer(sock)
        assert status == 413 and json.loads(body)["error"]["code"] == "payload_too_large"
        assert fields["connection"] == "close" and _closed(sock, 5) is not None
    with _connect(gw.port) as sock:
        # Chunked, as it passes the limit.
        sock.sendall(b"POST /api/v1/x HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(5):
            sock.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
        assert _answer(sock)[0] == 413
    assert upstream.heads == []
    assert gw.gateway.edge.counts.body_refused == 2
    assert "bodies 2" in gw.gateway.report()
    within = b"POST /api/v1/x HTTP/1.1\r\nHost: gw\r\nContent-Length: 4096\r\n\r\n" + b"x" * 4096
    assert _ask(gw.port, within)[0] == 200


def test_the_batch_uploads_path_takes_its_own_larger_body_limit(
    start_gateway: Callable[..., Running], upstream: Upstream, settings: Any
) -> None:
    settings.MAX_REQUEST_BODY_BYTES = 4096
    settings.BODY_LIMITS_BY_PATH = {"/v1/files": 16384}
    gw = start_gateway()
    big = b"x" * 8192
    upload = b"POST /v1/files?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Length: 8192\r\n\r\n" + big
    assert _ask(gw.port, upload)[0] == 200
    elsewhere = b"POST /v1/filesx HTTP/1.1\r\nHost: gw\r\nContent-Length: 8192\r\n\r\n" + big
    assert _ask(gw.port, elsewhere)[0] == 413
    over = b"POST /v1/files HTTP/1.1\r\nHost: gw\r\nContent-Length: 16385\r\n\r\n"
    with _connect(gw.port) as sock:
        sock.sendall(over)
        status, _, body = _answer(sock)
        assert status == 413 and b"16384" in body


# --- connections ----------------------------------------------------------------------------


def test_idle_and_slow_connections_are_closed_at_their_timeouts_and_counted(
    start_gateway: Callable[..., Running],
) -> None:
    gw = start_gateway(idle_timeout=1.0, read_timeout=1.0)
    silent = _connect(gw.port)  # connects, and never asks
    after_answer = _connect(gw.port)
    after_answer.sendall(GET_HEALTH)
    assert _answer(after_answer)[0] == 200
    slow = _connect(gw.port)
    slow.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: g")  # and the rest never comes
    for sock in (silent, after_answer):
        closed_in = _closed(sock, 5)
        assert closed_in is not None and closed_in < 3, "an idle connection was kept"
    status, _, body = _answer(slow)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    counts = gw.gateway.edge.counts
    assert (counts.idle_closed, counts.slow_closed) == (2, 1)
    assert "closed idle 2, slow 1" in gw.gateway.report()
    for sock in (silent, after_answer, slow):
        sock.close()


def test_connections_over_the_cap_close_the_one_idle_longest(
    start_gateway: Callable[..., Running],
) -> None:
    gw = start_gateway(max_connections=4)
    idle = [_connect(gw.port) for _ in range(4)]
    for sock in idle[1:]:
        sock.sendall(GET_HEALTH)
        assert _answer(sock)[0] == 200
    time.sleep(0.1)
    newcomer = _connect(gw.port)
    newcomer.sendall(GET_HEALTH)
    assert _answer(newcomer)[0] == 200, "the new connection is served"
    assert _closed(idle[0], 3) is not None, "the connection idle longest was closed"
    for sock in idle[1:]:
        sock.sendall(GET_HEALTH)
        assert _answer(sock)[0] == 200, "the others were kept"
    assert gw.gateway.edge.counts.evicted == 1
    for sock in (*idle, newcomer):
        sock.close()


# --- what is passed on ----------------------------------------------------------------------


def test_hop_by_hop_fields_are_not_passed_on_either_way(
    start_gateway: Callable[..., Running], upstream: Upstream
) -> None:
    upstream.reply_fields = [("Connection", "X-Upstream-Hop"), ("X-Upstream-Hop", "1")]
    gw = start_gateway()
    status, fields, _ = _ask(
        gw.port,
        b"GET /api/v1/health HTTP/1.1\r\nHost: gw\r\n"
        b"Connection: keep-alive, X-Secret-Hop\r\nX-Secret-Hop: token\r\n"
        b"Keep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Authorization: Basic eDp5\r\n"
        b"Proxy-Connection: keep-alive\r\nX-End-To-End: 1\r\n\r\n",
    )
    assert status == 200
    (head,) = upstream.heads
    assert head["x-end-to-end"] == "1"
    for name in ("x-secret-hop", "keep-alive", "te", "proxy-authorization", "proxy-connection"):
        assert name not in head, f"{name} was passed on"
    assert head["x-forwarded-for"] == "127.0.0.1"
    assert "x-upstream-hop" not in fields


def test_the_upstream_must_be_one_plain_http_origin() -> None:
    assert str(upstream_base("http://web:8000")) == "http://web:8000"
    for bad in ("ftp://web", "web:8000", "http://u:p@web", "http://web/?q=1", "http://web/#f"):
        with pytest.raises(ValueError, match="upstream"):
            upstream_base(bad)
