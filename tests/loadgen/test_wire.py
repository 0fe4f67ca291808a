"""The HTTP/1.1 reader: parsing is pure; the exchanges run against a real simulated engine."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from loadgen.wire import ConnectionPool, post, request


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_streams_and_reuses_the_connection(fast_sim: str) -> None:
    body = json.dumps(
        {
            "model": "deepseek-r1-distill-qwen-32b",
            "prompt": "a b c",
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()

    async def twice() -> tuple[list[int], int]:
        pool = ConnectionPool()
        statuses = []
        for _ in range(2):
            response = await post(
                pool, f"{fast_sim}/v1/completions", body, {"Content-Type": "application/json"}, 30
            )
            assert response.complete and not response.error
            text = b"".join(piece for _, piece in response.pieces)
            assert text.count(b"data: ") >= 6 and text.rstrip().endswith(b"[DONE]")
            times = [stamp for stamp, _ in response.pieces]
            assert times == sorted(times)
            statuses.append(response.head.status)
        idle = sum(len(conns) for conns in pool.idle.values())
        pool.close()
        return statuses, idle

    statuses, idle = _run(twice())
    assert statuses == [200, 200]
    assert idle == 1  # the second request reused the first one's connection


def test_a_get_without_a_body_on_the_pooled_connection(fast_sim: str) -> None:
    async def go() -> tuple[list[int], bytes, int]:
        pool = ConnectionPool()
        statuses, answer = [], b""
        for _ in range(2):
            response = await request(pool, "GET", f"{fast_sim}/v1/models", None, {}, 30)
            assert response.complete and not response.error
            statuses.append(response.head.status)
            answer = b"".join(piece for _, piece in response.pieces)
        idle = sum(len(conns) for conns in pool.idle.values())
        pool.close()
        return statuses, answer, idle

    statuses, answer, idle = _run(go())
    assert statuses == [200, 200]
    assert json.loads(answer)["data"][0]["id"] == "deepseek-r1-distill-qwen-32b"
    assert idle == 1


def test_error_response_with_content_length(fast_sim: str) -> None:
    body = json.dumps({"model": "no-such-model", "prompt": "a", "max_tokens": 2}).encode()

    async def go() -> tuple[int, bytes]:
        pool = ConnectionPool()
        response = await post(
            pool, f"{fast_sim}/v1/completions", body, {"Content-Type": "application/json"}, 30
        )
        pool.close()
        return response.head.status, b"".join(piece for _, piece in response.pieces)

    status, text = _run(go())
    assert status == 404
    assert b"no-such-model" in text


def test_refused_connection_raises_oserror() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def go() -> None:
        await post(ConnectionPool(), f"http://127.0.0.1:{port}/v1/completions", b"{}", {}, 5)

    with pytest.raises(OSError):
        _run(go())


def test_a_connection_idle_too_long_is_not_reused(fast_sim: str) -> None:
    body = json.dumps({"model": "deepseek-r1-distill-qwen-32b", "prompt": "a", "max_tokens": 1})

    async def go() -> tuple[int, int]:
        pool = ConnectionPool(max_idle_s=0.05)
        url = f"{fast_sim}/v1/completions"
        headers = {"Content-Type": "application/json"}
        await post(pool, url, body.encode(), headers, 30)
        ((_, first),) = next(iter(pool.idle.values()))
        await asyncio.sleep(0.1)
        await post(pool, url, body.encode(), headers, 30)
        ((_, second),) = next(iter(pool.idle.values()))
        pool.close()
        return id(first), id(second)

    first, second = _run(go())
    assert first != second


def test_a_response_whose_end_spans_reads_completes_with_every_stamp_kept() -> None:
    from loadgen.wire import _Connection

    async def check() -> None:
        conn = _Connection()
        done = asyncio.get_running_loop().create_future()
        conn.done = done
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.data_received(head + b"7\r\ndata: a\r\n")
        conn.data_received(b"7\r\ndata: b\r\n0\r\n\r")
        assert not done.done()  # the blank line after the last chunk is not in yet
        conn.data_received(b"\n")
        assert done.done()
        response = conn.response()
        assert response.complete and response.head.status == 200
        assert [p for _, p in response.pieces] == [b"data: a", b"data: b"]
        stamps = [t for t, _ in response.pieces]
        assert stamps[0] < stamps[1]  # each piece keeps the stamp of the read that brought it

    asyncio.run(check())
