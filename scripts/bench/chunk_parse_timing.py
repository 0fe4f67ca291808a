"""Time the engine clients' HTTP/1.1 parser (httptools) against a hand-written one.

    .venv/bin/python scripts/bench/chunk_parse_timing.py [--tokens 256] [--streams 200]

The router's engine client and the load generator parse engines' token streams with
``common.http1.ResponseParser`` (httptools, llhttp). Before it, both had a chunk
splitter of their own in Python; ``hand_split_chunks`` below is that splitter, kept here as
the reference. This builds the response an engine sends for one streamed chat answer (a
head, then one chunked SSE event per token, each arriving in a read of its own as on the
wire) and parses it both ways, checking that both give the same payloads:

- per read, as the router (and now the load generator) does: each read is parsed as it
  arrives;
- whole, as the load generator did before: the complete body is parsed once it arrived.

It prints the median microseconds per stream of each, and their ratio
(docs/decisions/0027-engine-clients-httptools.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.http1 import ResponseParser  # noqa: E402

HEAD_END = b"\r\n\r\n"


def hand_split_chunks(buffer: bytes, pos: int = 0) -> tuple[list[bytes], int, bool]:
    """The hand-written splitter: the complete chunks from ``pos``, the offset of the first
    unparsed byte, and whether the last chunk (and its blank line) arrived."""
    chunks: list[bytes] = []
    end = len(buffer)
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            return chunks, pos, False
        size = int(buffer[pos:eol].split(b";", 1)[0].strip(), 16)
        if size == 0:
            close = buffer.find(HEAD_END, eol) if buffer[eol + 2 : eol + 4] != b"\r\n" else eol
            return (chunks, close + 4, True) if close >= 0 else (chunks, pos, False)
        start = eol + 2
        if start + size + 2 > end:
            return chunks, pos, False
        chunks.append(buffer[start : start + size])
        pos = start + size + 2


def _field(block: bytes, name: bytes) -> bytes:
    at = block.find(b"\r\n" + name + b":")
    if at < 0:
        return b""
    start = at + len(name) + 3
    stop = block.find(b"\r\n", start)
    return block[start : stop if stop >= 0 else len(block)].strip()


def engine_stream(tokens: int) -> tuple[bytes, list[bytes], bytes]:
    """(head, reads, expected body): one chunked SSE event per read, as vLLM streams."""
    head = (
        b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 03:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    reads, body = [], []
    for i in range(tokens):
        event = {
            "id": "chatcmpl-0123456789abcdef",
            "object": "chat.completion.chunk",
            "created": 1796170000,
            "model": "tiny",
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
        }
        payload = b"data: " + json.dumps(event).encode() + b"\n\n"
        body.append(payload)
        reads.append(b"%x\r\n" % len(payload) + payload + b"\r\n")
    done = b"data: [DONE]\n\n"
    body.append(done)
    reads.append(b"%x\r\n" % len(done) + done + b"\r\n0\r\n\r\n")
    return head, reads, b"".join(body)


def hand_per_read(head: bytes, reads: list[bytes]) -> bytes:
    end = head.find(HEAD_END)
    fields = b"\r\n" + head[:end].partition(b"\r\n")[2].lower()
    assert b"chunked" in _field(fields, b"transfer-encoding")
    out: list[bytes] = []
    buffer = b""
    for data in reads:
        data = buffer + data if buffer else data
        chunks, consumed, finished = hand_split_chunks(data)
        buffer = data[consumed:]
        out.append(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        if finished:
            break
    return b"".join(out)


def hand_whole(head: bytes, reads: list[bytes]) -> bytes:
    raw = head + b"".join(reads)
    end = raw.find(HEAD_END) + 4
    chunks, _, finished = hand_split_chunks(raw, end)
    assert finished
    return b"".join(chunks)


def parser_per_read(head: bytes, reads: list[bytes]) -> bytes:
    parser = ResponseParser()
    parser.feed(head)
    assert parser.header("transfer-encoding") == "chunked"
    out = [parser.feed(data) for data in reads]
    assert parser.complete
    return b"".join(out)


def parser_whole(head: bytes, reads: list[bytes]) -> bytes:
    parser = ResponseParser()
    body = parser.feed(head + b"".join(reads))
    assert parser.complete
    return body


def median_us(
    fn: Callable[[bytes, list[bytes]], bytes], head: bytes, reads: list[bytes], streams: int
) -> float:
    times = []
    for _ in range(streams):
        started = time.perf_counter()
        fn(head, reads)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=200)
    args = parser.parse_args()
    head, reads, expected = engine_stream(args.tokens)
    for fn in (hand_per_read, hand_whole, parser_per_read, parser_whole):
        if fn(head, reads) != expected:
            sys.exit(f"{fn.__name__} parsed a different body")
    print(
        f"one streamed answer: {args.tokens} tokens, {len(reads)} reads, "
        f"{len(expected)} payload bytes; median of {args.streams} streams, interleaved runs"
    )
    rows = []
    for label, ours, theirs in (
        ("per read", hand_per_read, parser_per_read),
        ("whole body", hand_whole, parser_whole),
    ):
        ours_t, theirs_t = [], []
        for _ in range(5):  # interleaved, so machine noise hits both alike
            ours_t.append(median_us(ours, head, reads, args.streams))
            theirs_t.append(median_us(theirs, head, reads, args.streams))
        a, b = statistics.median(ours_t), statistics.median(theirs_t)
        rows.append((label, a, b))
    print(f"{'':30} {'hand-written':>14} {'httptools':>12} {'httptools/hand':>15}")
    for label, a, b in rows:
        print(f"{label:30} {a:11.1f} us {b:9.1f} us {b / a:14.2f}x")
        print(f"{'  per read':30} {a / len(reads):11.3f} us {b / len(reads):9.3f} us")


if __name__ == "__main__":
    main()
