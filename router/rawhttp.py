"""A minimal HTTP/1.1 client for the passthrough hot path.

aiohttp's client costs a few hundred microseconds of CPU per request (request objects,
header multidicts, stream reader); a passthrough needs none of that. This client writes the
request in one syscall on a pooled keep-alive connection, parses the status line and
headers, and yields each read's complete chunk payloads joined, so several tokens that
arrive together cost one client write. Anything unusual (no length, an upgrade) is an
error, never a guess. Closing the connection is how the engine learns the client left.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from router.upstream import UpstreamFailed
from router.watchdog import WATCHDOG

if TYPE_CHECKING:
    from router.backends import Backend

READ_SIZE = 1 << 16
MAX_HEAD = 1 << 16


class RawPool:
    """Idle keep-alive connections to one engine."""

    def __init__(self, url: str, connect_timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"raw client supports http:// URLs only, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode()
        self.prefix = parts.path.rstrip("/").encode()
        self.connect_timeout = connect_timeout
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def acquire(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A connection and whether it was reused (a reused one may have been closed)."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer, True
            writer.close()
        async with asyncio.timeout(self.connect_timeout):
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEAD)
        return reader, writer, False

    def release(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.idle.append((reader, writer))

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


class RawResponse:
    def __init__(
        self,
        pool: RawPool,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        status: int,
        chunked: bool,
        length: int | None,
        keep_alive: bool,
        content_type: str,
    ) -> None:
        self.pool = pool
        self.reader = reader
        self.writer = writer
        self.status = status
        self.chunked = chunked
        self.length = length
        self.keep_alive = keep_alive
        self.content_type = content_type
        self.done = False

    def close(self) -> None:
        self.writer.close()

    def finish(self) -> None:
        """Return the connection to the pool if the body was read to its end, else close it."""
        if self.done and self.keep_alive:
            self.pool.release(self.reader, self.writer)
        else:
            self.writer.close()

    async def iter_body(self, backend: Backend, first: float) -> AsyncIterator[bytes]:
        """Body payload as it arrives: ``first`` s for the first read, idle timeout after."""
        try:
            async for data in self._iter_body(first, backend.timeouts.idle):
                yield data
        except _Broken as exc:
            raise UpstreamFailed(backend, str(exc)) from None

    async def _iter_body(self, first: float, idle: float) -> AsyncIterator[bytes]:
        if self.length == 0:
            self.done = True
            return
        loop = asyncio.get_running_loop()
        watch = WATCHDOG.watch(self, loop.time() + first)
        limit = first
        reader = self.reader
        buffer = b""
        remaining = self.length
        try:
            while True:
                watch.deadline = loop.time() + limit
                try:
                    data = await reader.read(READ_SIZE)
                except (ConnectionError, OSError) as exc:
                    raise _Broken(f"stream broken: {exc!r}", watch.fired, limit) from None
                if watch.fired:
                    raise _Broken("silent", True, limit)
                watch.deadline = math.inf
                limit = idle
                if not data:
                    if remaining is None and not self.chunked:
                        self.done = True  # body delimited by close
                        return
                    raise _Broken("engine closed the stream early", False, limit)
                if not self.chunked:
                    if remaining is not None:
                        remaining -= len(data)
                        if remaining <= 0:
                            self.done = True
                            if data:
                                yield data
                            return
                    yield data
                    continue
                buffer += data
                out, buffer, finished = _dechunk(buffer)
                if out:
                    yield out
                if finished:
                    self.done = True
                    return
        finally:
            WATCHDOG.active.discard(watch)


class _Broken(Exception):
    def __init__(self, message: str, timed_out: bool, limit: float) -> None:
        super().__init__(f"silent for {limit:g}s" if timed_out else message)


def _dechunk(buffer: bytes) -> tuple[bytes, bytes, bool]:
    """Split complete chunks off ``buffer``: (joined payloads, rest, saw the last chunk)."""
    parts: list[bytes] = []
    pos = 0
    end = len(buffer)
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            break
        size_field = buffer[pos:eol].split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise _Broken(f"bad chunk size {size_field[:20]!r}", False, 0) from None
        if size == 0:
            # The last chunk; trailers (none from engines) end with an empty line.
            if buffer.find(b"\r\n", eol + 2) < 0:
                break
            return b"".join(parts), b"", True
        start = eol + 2
        if start + size + 2 > end:
            break
        parts.append(buffer[start : start + size])
        pos = start + size + 2
    return b"".join(parts), buffer[pos:], False


def _field(fields: bytes, name: bytes) -> bytes:
    """The value of header ``name`` in a lower-cased header block, or b"" if absent."""
    at = fields.find(b"\r\n" + name + b":")
    if at < 0:
        return b""
    start = at + len(name) + 3
    end = fields.find(b"\r\n", start)
    return fields[start : end if end >= 0 else len(fields)].strip()


async def request(
    pool: RawPool, path: str, body: bytes, *, first_byte: float
) -> tuple[RawResponse | None, str | None, bool]:
    """POST ``body``; returns (response, error, connect_failed). Retries once when a pooled
    keep-alive connection turns out to be closed by the engine."""
    head = (
        b"POST "
        + pool.prefix
        + path.encode()
        + b" HTTP/1.1\r\nHost: "
        + pool.host_header
        + b"\r\nContent-Type: application/json\r\nAccept: */*\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    for attempt in range(2):
        try:
            reader, writer, reused = await pool.acquire()
        except (OSError, TimeoutError) as exc:
            return None, f"connect failed: {exc!r}", True
        try:
            writer.write(head + body)
            async with asyncio.timeout(first_byte):
                raw = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            writer.close()
            return None, f"no response within {first_byte:g}s", False
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            writer.close()
            if reused and attempt == 0:
                continue
            return None, f"request failed: {exc!r}", False
        except asyncio.LimitOverrunError:
            writer.close()
            return None, "response head too large", False
        except BaseException:
            # Cancelled (the client left): closing the socket makes the engine abort.
            writer.close()
            raise
        break
    first_line, _, fields = raw.partition(b"\r\n")
    try:
        status = int(first_line.split(b" ", 2)[1])
    except (IndexError, ValueError):
        writer.close()
        return None, f"malformed status line {first_line[:40]!r}", False
    # Only four fields matter; look them up in the lower-cased block, not line by line.
    fields = b"\r\n" + fields.lower()
    chunked = b"chunked" in _field(fields, b"transfer-encoding")
    length_field = _field(fields, b"content-length")
    try:
        length = int(length_field) if length_field else None
    except ValueError:
        writer.close()
        return None, f"bad content-length {length_field[:20]!r}", False
    keep_alive = b"close" not in _field(fields, b"connection")
    content_type = _field(fields, b"content-type").split(b";")[0].decode("latin-1")
    content_type = content_type or "application/json"
    if not chunked and length is None:
        keep_alive = False  # body ends when the engine closes
    return (
        RawResponse(pool, reader, writer, status, chunked, length, keep_alive, content_type),
        None,
        False,
    )
