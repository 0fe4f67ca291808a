"""The HTTP/1.1 response parser both engine clients use (router and load generator)."""

from __future__ import annotations

import pytest

from common.http1 import FramingError, ResponseParser

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
BODY = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"


def _feed(parser: ResponseParser, reads: list[bytes]) -> list[bytes]:
    return [parser.feed(read) for read in reads]


def test_a_chunked_body_split_across_reads_anywhere_comes_out_whole_and_in_order() -> None:
    whole = HEAD + BODY
    for cut in range(len(whole) + 1):
        parser = ResponseParser()
        first = parser.feed(whole[:cut])
        assert parser.complete is (cut == len(whole))
        rest = parser.feed(whole[cut:])
        assert first + rest == b"hello world", cut
        assert parser.complete and parser.status == 200


def test_the_head_gives_status_reason_fields_and_keep_alive() -> None:
    parser = ResponseParser()
    assert parser.feed(HEAD[:20]) == b"" and not parser.head_complete
    parser.feed(HEAD[20:] + b"3;ext=1\r\nabc\r\n")  # a chunk extension is ignored
    assert (parser.status, parser.reason, parser.keep_alive) == (200, "OK", True)
    assert parser.header("content-type") == "text/event-stream"
    assert parser.header("x-missing") == "" and parser.delimited
    assert not parser.complete
    assert parser.feed(b"0\r\nX-Trailer: 1\r\n\r\n") == b"" and parser.complete


def test_content_length_bodies_and_closing_connections() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\nConnection: close\r\n\r\nab")
    assert (parser.status, parser.reason, parser.keep_alive, parser.complete) == (
        404,
        "Not Found",
        False,
        False,
    )
    assert parser.feed(b"cde") == b"cde" and parser.complete
    # A body without a length ends when the server closes; a cut-off one does not.
    open_ended = ResponseParser()
    assert open_ended.feed(b"HTTP/1.1 200 OK\r\n\r\nsome") == b"some"
    assert not open_ended.delimited and open_ended.closed()
    cut = ResponseParser()
    cut.feed(HEAD + b"5\r\nhel")
    assert not cut.closed()


def test_bad_framing_is_an_error() -> None:
    with pytest.raises(FramingError):
        ResponseParser().feed(HEAD + b"zz\r\nhello\r\n")
    with pytest.raises(FramingError):
        ResponseParser().feed(b"garbage\r\n\r\n")
