"""The gateway's HTTP/1.1 server (``syshax/common/http1_server.py``), over raw sockets: what
it frames, refuses, keeps alive and closes, byte for byte."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
import pytest
import uvloop

from syshax.common.http1_server import Limits, Reply, Request, Server


async def _handler(request: Request, reply: Reply) -> None:
    """Echoes what it was sent; a few paths do something else."""
    if request.path == "/boom":
        raise RuntimeError("a secret in a traceback")
    if request.path == "/stream":
        await reply.start(200, [("Content-Type", "text/plain")], None)
        for part in (b"one,", b"two,", b"three"):
            await reply.write(part)
        reply.end()
        return
    if request.path == "/slow":
        await asyncio.sleep(0.3)
    reply.send_json(
        200,
        {
            "method": request.method,
            "path": request.path,
            "query": request.query(),
            "body": request.body.decode(),
            "type": request.content_type,
            "agent": request.header("x-agent"),
        },
    )


@pytest.fixture(params=["asyncio", "uvloop"], autouse=True)
def loop_kind(request: pytest.FixtureRequest) -> None:
    """Every test on both loops: the gateway runs on uvloop, whose transports differ."""
    global LOOP
    LOOP = asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop


LOOP: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop


def _run(check: Callable[[str, int, Server], Awaitable[None]], **limits: Any) -> None:
    async def main() -> None:
        server = Server(_handler, Limits(**{"max_body": 1000, "read_timeout": 0.5, **limits}))
        await server.listen("127.0.0.1", 0)
        assert server.server is not None
        port = server.server.sockets[0].getsockname()[1]
        try:
            await asyncio.wait_for(check("127.0.0.1", port, server), 20)
        finally:
            await server.close(grace=1.0)

    with asyncio.Runner(loop_factory=LOOP) as runner:
        runner.run(main())


@dataclass
class Answer:
    status: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    parts: list[bytes] = field(default_factory=list)
    complete: bool = False

    def body(self) -> bytes:
        return b"".join(self.parts)


class Answers:
    """Every answer a connection carries, as they complete (pipelined ones included)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Answer] = []
        self.current = Answer()

    def on_message_begin(self) -> None:
        self.current = Answer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.fields[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current.parts.append(body)

    def on_message_complete(self) -> None:
        self.current.complete = True
        self.done.append(self.current)

    async def next(self) -> Answer:
        while not self.done:
            data = await self.reader.read(65536)
            if not data:
                self.parser.feed_data(b"")  # a close-delimited body ends here
                if not self.done:
                    raise AssertionError("closed before a whole answer")
                break
            self.parser.feed_data(data)
        return self.done.pop(0)


def test_kept_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async def check(host: str, port: int, server: Server) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(
            b"GET /slow?a=1&a=2&b= HTTP/1.1\r\nHost: x\r\nX-Agent: one\r\n\r\n"
            b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Type: application/json; charset=utf-8\r\n"
            b'Content-Length: 7\r\n\r\n{"a":1}'
        )
        await writer.drain()
        first = await answers.next()
        assert first.status == 200 and "connection" not in first.fields
        assert json.loads(first.body()) == {
            "method": "GET",
            "path": "/slow",
            "query": {"a": ["1", "2"], "b": [""]},
            "body": "",
            "type": "",
            "agent": "one",
        }
        second = await answers.next()
        assert json.loads(second.body())["body"] == '{"a":1}'
        assert json.loads(second.body())["type"] == "application/json"
        assert "date" in second.fields
        # More than are read ahead at once: the connection stops reading and goes on.
        writer.write(b"".join(b"GET /n%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(12)))
        paths = [json.loads((await answers.next()).body())["path"] for _ in range(12)]
        assert paths == [f"/n{i}" for i in range(12)]
        writer.write(b"GET /again HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        third = await answers.next()
        assert third.fields["connection"] == "close"
        assert await reader.read() == b"", "closed after the answer it asked to close after"
        writer.close()

    _run(check)


def test_a_chunked_body_is_read_whole_and_expect_100_is_answered() -> None:
    async def check(host: str, port: int, server: Server) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(
            b"PUT /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        answer = await answers.next()
        assert answer.status == 200 and json.loads(answer.body())["body"] == "abcde"
        writer.close()

    _run(check)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n",
        b"POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"200\r\n"
        + b"x" * 512
        + b"\r\n"
        + b"200\r\n"
        + b"x" * 512
        + b"\r\n",
    ],
    ids=["declared", "chunked"],
)
def test_a_body_over_the_limit_is_a_413_and_the_connection_closes(request_bytes: bytes) -> None:
    async def check(host: str, port: int, server: Server) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(request_bytes)
        answer = await answers.next()
        assert answer.status == 413 and answer.fields["connection"] == "close"
        error = json.loads(answer.body())["error"]
        assert error["code"] == "payload_too_large" and "1000 bytes" in error["message"]
        assert await reader.read() == b""
        writer.close()

    _run(check)


def test_a_request_that_does_not_arrive_whole_in_time_is_a_408() -> None:
    async def check(host: str, port: int, server: Server) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(b"POST /late HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        answer = await answers.next()
        assert answer.status == 408
        assert "0.5 s" in json.loads(answer.body())["error"]["message"]
        writer.close()

    _run(check)


def test_garbage_is_a_400_and_a_failing_handler_a_500_without_its_traceback() -> None:
    async def check(host: str, port: int, server: Server) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        failed = await answers.next()
        assert failed.status == 500 and b"secret" not in failed.body()
        assert json.loads(failed.body())["error"]["code"] == "server_error"
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        garbage = await answers.next()
        assert (
            garbage.status == 400 and json.loads(garbage.body())["error"]["code"] == "bad_request"
        )
        assert await reader.read() == b""
        writer.close()

    _run(check)


def test_streamed_answers_are_chunked_for_http_1_1_and_close_delimited_for_1_0() -> None:
    async def check(host: str, port: int, server: Server) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        chunked = await answers.next()
        assert chunked.fields["transfer-encoding"] == "chunked"
        assert chunked.body() == b"one,two,three"
        writer.write(b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"one" not in head
        writer.close()
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(b"GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        raw = await reader.read()  # to the close: that is where the body ends
        assert b"Transfer-Encoding" not in raw and raw.endswith(b"\r\n\r\none,two,three")
        assert b"Connection: close" in raw
        writer.close()

    _run(check)


def test_idle_connections_close_and_closing_lets_an_answer_under_way_finish() -> None:
    async def check(host: str, port: int, server: Server) -> None:
        idle_reader, idle_writer = await asyncio.open_connection(host, port)
        await asyncio.sleep(0.1)
        assert len(server.connections) == 1
        assert await asyncio.wait_for(idle_reader.read(), 2) == b"", "idle past its keep-alive"
        idle_writer.close()
        reader, writer = await asyncio.open_connection(host, port)
        answers = Answers(reader)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        closing = asyncio.create_task(server.close(grace=5.0))
        answer = await answers.next()
        assert answer.status == 200, "the answer under way went out"
        await closing
        assert server.connections == set()
        writer.close()

    _run(check, keepalive_timeout=0.5)
