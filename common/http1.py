"""HTTP/1.1 responses, parsed as their bytes arrive: the one parser of both engine clients.

The router's engine client (``router/engines/transport.py``) and the load generator's timed client
(``loadgen/wire.py``) read OpenAI-compatible servers (vLLM's uvicorn, the simulator,
the router) from bare asyncio protocols. Both feed each socket read to a ``ResponseParser``,
which is httptools (llhttp, the parser uvicorn uses) with the few callbacks they need: the
status and header fields once the head is in, the body bytes each read completed (chunk
framing removed), and the end of the message. ``scripts/bench/chunk_parse_timing.py`` times it
against the hand-written chunk splitter it replaced: a third of its CPU per read
(docs/decisions/0027-engine-clients-httptools.md).
"""

from __future__ import annotations

import httptools


class FramingError(ValueError):
    """The bytes are not a well-formed HTTP/1.1 response."""


class ResponseParser:
    """One response at a time (``reset`` between two on a kept-alive connection)."""

    __slots__ = (
        "_body",
        "_parser",
        "chunked",
        "complete",
        "content_length",
        "delimited",
        "head_complete",
        "headers",
        "keep_alive",
        "reason",
        "status",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self.status = 0
        self.reason = ""
        # Field names lower-cased, in arrival order; a repeated field appears once per line.
        self.headers: list[tuple[str, str]] = []
        self.head_complete = False
        self.keep_alive = False
        # The body has a length (Content-Length or chunked); else it ends when the server
        # closes the connection.
        self.delimited = False
        self.chunked = False
        self.content_length: int | None = None
        self.complete = False

    # -- httptools callbacks ---------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1").strip()))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self.chunked = "chunked" in self.header("transfer-encoding").lower()
        length = self.header("content-length")
        self.content_length = int(length) if length.isdigit() and not self.chunked else None
        # 1xx, 204 and 304 answers have no body, whatever their fields say.
        self.delimited = (
            self.chunked or self.content_length is not None or self.status in (204, 304)
        )
        self.head_complete = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- use -------------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """Parse one read; returns the body bytes it carried (b"" for none)."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise FramingError("the server switched protocols") from None
        except httptools.HttpParserError as exc:
            raise FramingError(f"malformed response: {exc}") from None
        body = self._body
        if not body:
            return b""
        self._body = []
        return body[0] if len(body) == 1 else b"".join(body)

    def closed(self) -> bool:
        """The server closed the connection: whether that completes the message (a body
        without a length ends there; a cut-off one does not)."""
        if self.head_complete and not self.delimited:
            self.complete = True
        return self.complete

    def header(self, name: str) -> str:
        """The last value of field ``name`` (lower case), or "" if absent."""
        for field, value in reversed(self.headers):
            if field == name:
                return value
        return ""
