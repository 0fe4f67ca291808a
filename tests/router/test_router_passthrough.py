"""The passthrough pump: long streams byte-exact, HTTP/1.0 clients, a slow reader."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
from router_procs import MODEL, Proc


def sse_events(body: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in body.split(b"\n\n") if e.startswith(b"data: ")]


def dechunk(raw: bytes) -> bytes:
    out, pos = [], 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[eol + 2 : eol + 2 + size])
        assert raw[eol + 2 + size : eol + 4 + size] == b"\r\n", "chunk framing broken"
        pos = eol + 4 + size


def raw_post(router: Proc, version: str, body: dict[str, object], pause: float = 0.0) -> bytes:
    """POST over a plain socket and return everything the router sent before closing."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions {version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(head + payload)
        if pause:
            time.sleep(pause)  # a client that does not read for a while
        parts = []
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return b"".join(parts)
            parts.append(data)


def check_stream(body: bytes, tokens: int) -> None:
    events = sse_events(body)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == tokens
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(texts) == tokens


def test_long_stream_arrives_intact_through_the_direct_writer(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only")
    body = {
        "model": MODEL,
        "prompt": "count for me",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = raw_post(router, "HTTP/1.1", body)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"transfer-encoding: chunked" in head.lower()
    check_stream(dechunk(rest), 400)
    # The same engine bytes as a direct request, event for event (ids aside).
    direct = httpx.post(gpu.url + "/v1/completions", json=body, timeout=30).content
    assert len(sse_events(direct)) == len(sse_events(dechunk(rest)))


def test_http10_client_gets_an_unchunked_stream(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only")
    body = {
        "model": MODEL,
        "prompt": "count for me",
        "max_tokens": 50,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = raw_post(router, "HTTP/1.0", body)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"chunked" not in head.lower()
    check_stream(rest, 50)


def test_a_slow_reader_gets_every_byte(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    """A client that stops reading while ~300 kB stream: the router holds back (and stops
    reading the engine) instead of dropping or reordering anything."""
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only")
    body = {
        "model": MODEL,
        "prompt": "count for me " * 50,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = raw_post(router, "HTTP/1.1", body, pause=1.5)
    check_stream(dechunk(raw.partition(b"\r\n\r\n")[2]), 2000)
