"""A Batch API request body on its way to the control plane, never held whole in memory.

A body with a ``Content-Length`` is streamed through as it arrives, with that length (the
control plane's web server refuses ``Transfer-Encoding: chunked`` with a 411); one past the
cap is refused by its length before anything is sent. A chunked body is spooled first, in
memory up to ``SPOOL_IN_MEMORY`` and on disk past it, then sent with the length it turned
out to have; past the cap it is refused and nothing is sent. Either way a request holds
about ``SPOOL_IN_MEMORY`` plus a read chunk, whatever the body's size.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from typing import IO

from aiohttp import web

from router.client.errors import RouterError

READ_CHUNK = 64 * 1024
SPOOL_IN_MEMORY = 1024 * 1024


class BodyCutShort(Exception):
    """The client's body ended before its Content-Length: the upstream request is aborted,
    so the control plane never takes a truncated upload for a whole one."""


def too_large(size: int, limit: int) -> RouterError:
    return RouterError(
        413,
        f"the request body is {size} bytes or more; the Batch API takes at most {limit} bytes",
        code="body_too_large",
    )


class Upload:
    """The body to send upstream: ``length`` bytes from ``chunks()``, or none at all."""

    def __init__(self, http: web.Request, length: int, spool: IO[bytes] | None) -> None:
        self._http = http
        self.length = length
        self._spool = spool

    @classmethod
    async def receive(cls, http: web.Request, limit: int) -> Upload:
        """The request's body, ready to stream: refused with a 413 past ``limit`` bytes (by
        its Content-Length before any of it is read, or as a chunked one is spooled)."""
        length = http.content_length
        if length is not None:
            if length > limit:
                raise too_large(length, limit)
            return cls(http, length, None)
        if not http.body_exists:
            return cls(http, 0, None)
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115
        try:
            size = 0
            while chunk := await http.content.read(READ_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise too_large(size, limit)
                spool.write(chunk)
            spool.seek(0)
        except BaseException:
            spool.close()
            raise
        return cls(http, size, spool)

    def headers(self) -> dict[str, str]:
        return {"Content-Length": str(self.length)} if self.length or self._spool else {}

    def data(self) -> AsyncIterator[bytes] | None:
        return self._chunks() if self.length else None

    async def _chunks(self) -> AsyncIterator[bytes]:
        sent = 0
        while sent < self.length:
            if self._spool is not None:
                chunk = self._spool.read(min(READ_CHUNK, self.length - sent))
            else:
                chunk = await self._http.content.read(min(READ_CHUNK, self.length - sent))
            if not chunk:
                raise BodyCutShort(f"the body ended after {sent} of {self.length} bytes")
            sent += len(chunk)
            yield chunk

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
