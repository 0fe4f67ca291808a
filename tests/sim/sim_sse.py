"""A raw Server-Sent-Events reader over a plain socket: no HTTP or SSE library involved."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawStream:
    status: int
    headers: dict[str, str]
    events: list[str] = field(default_factory=list)  # the data: payloads, in order
    arrival: list[float] = field(default_factory=list)  # time.time() of each event

    def json_events(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def _read_chunked(sock: socket.socket, buf: bytes) -> tuple[bytes, list[tuple[bytes, float]]]:
    """Decode a chunked body; returns (body, [(chunk, arrival time)])."""
    chunks: list[tuple[bytes, float]] = []
    body = b""

    def fill(n: int) -> None:
        nonlocal buf
        while len(buf) < n:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed inside a chunk")
            buf += data

    while True:
        while b"\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed before the last chunk")
            buf += data
        line, buf = buf.split(b"\r\n", 1)
        size = int(line.split(b";")[0], 16)
        fill(size + 2)
        chunk, buf = buf[:size], buf[size + 2 :]
        if size == 0:
            return body, chunks
        chunks.append((chunk, time.time()))
        body += chunk


def post_sse(port: int, path: str, payload: dict[str, Any], timeout: float = 30) -> RawStream:
    body = json.dumps(payload).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("no response head")
            buf += data
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        stream = RawStream(status=status, headers=headers)
        if headers.get("transfer-encoding") != "chunked":
            return stream
        _, chunks = _read_chunked(sock, rest)
    pending = b""
    for chunk, arrived in chunks:
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            for line in event.decode().split("\n"):
                if line.startswith("data: "):
                    stream.events.append(line[len("data: ") :])
                    stream.arrival.append(arrived)
    return stream
