"""Server-sent events, read from a byte stream: the one parser of the router and the load
generator.

An event ends at a blank line; a line ends with CRLF, LF or CR (the SSE specification
allows all three, and a proxy may rewrite one into another). A read may end anywhere,
even between the CR and LF of one line end, so :func:`split_events` keeps what is not yet a
whole event in the caller's buffer.
"""

from __future__ import annotations

DONE_DATA = b"[DONE]"


def split_events(buffer: bytearray, *, final: bool = False) -> list[bytes]:
    """Remove and return every complete event from ``buffer`` (line ends made LF).

    ``final``: the stream has ended, so a CR at the end is a whole line end, and what is
    left is its last event even without the blank line after it."""
    if b"\r" in buffer:
        # A CR at the very end may be the first half of a CRLF: keep it until the next read.
        held = buffer.endswith(b"\r") and not final
        body = bytes(buffer[:-1] if held else buffer)
        buffer[:] = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if held else b"")
    events: list[bytes] = []
    start = 0
    while (end := buffer.find(b"\n\n", start)) >= 0:
        events.append(bytes(buffer[start:end]))
        start = end + 2
    if buffer.endswith(b"\n\r") and len(buffer) - start >= 2:
        # A line end, then the held CR: a blank line whatever follows (an LF would only
        # finish the CR's CRLF). The event is whole; the CR stays, so that LF is one line end.
        events.append(bytes(buffer[start:-2]))
        start = len(buffer) - 1
    if start:
        del buffer[:start]
    if final and buffer.strip():
        events.append(bytes(buffer))
    if final:
        buffer.clear()
    return events


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's ``data:`` line(s), joined by LF; None for an event without
    one (a comment such as a keep-alive ping, or another field)."""
    data: list[bytes] = []
    for line in event.split(b"\n"):
        line = line.rstrip(b"\r")
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None
