"""Deadlines for engine I/O and requests: one 100 ms ticker serves them all.

A stream's idle deadline moves on every read, hundreds of times a second across the
router's streams; arming and cancelling an event-loop timer for each would cost more than
the read. Here a deadline is an entry in one set, and moving it is an attribute store. Two
forms, both context managers:

- ``closing(target, seconds)``: when the deadline passes, ``target.close()`` is called (an
  engine connection: the wait on it ends with the connection's own error, and ``fired``
  says why);
- ``cancel_after(seconds)``: when it passes, the current task is cancelled and the block
  raises ``TimeoutError``, as ``asyncio.timeout`` does (nested ones each take back their
  own cancellation).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Protocol

TICK = 0.1


class Closeable(Protocol):
    def close(self) -> None: ...


class Deadline:
    """One deadline: ``at`` is on the event loop's clock; ``math.inf`` holds it."""

    __slots__ = ("at", "fired", "target")

    def __init__(self, target: Closeable, at: float) -> None:
        self.target = target
        self.at = at
        self.fired = False

    def hold(self) -> None:
        """Stop the clock (the consumer holds the data: a slow client is not a slow engine)."""
        self.at = math.inf


class _CancelTask:
    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task

    def close(self) -> None:
        self.task.cancel()


class Deadlines:
    """The router's deadlines, checked every ``TICK`` seconds by one task per event loop."""

    def __init__(self) -> None:
        self._active: set[Deadline] = set()
        self._task: asyncio.Task[None] | None = None

    @contextmanager
    def closing(self, target: Closeable, seconds: float) -> Iterator[Deadline]:
        """Close ``target`` if the block is still running ``seconds`` from now (or after the
        deadline was moved with ``deadline.at = ...``)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        deadline = Deadline(target, loop.time() + seconds)
        self._active.add(deadline)
        try:
            yield deadline
        finally:
            self._active.discard(deadline)

    @asynccontextmanager
    async def cancel_after(self, seconds: float) -> AsyncIterator[Deadline]:
        """Cancel the current task past ``seconds``; the block then raises TimeoutError."""
        task = asyncio.current_task()
        assert task is not None
        with self.closing(_CancelTask(task), seconds) as deadline:
            try:
                yield deadline
            except asyncio.CancelledError:
                if not deadline.fired:
                    raise
                task.uncancel()
                raise TimeoutError from None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK)
            now = loop.time()
            for deadline in [d for d in self._active if now > d.at]:
                deadline.fired = True
                self._active.discard(deadline)
                deadline.target.close()


DEADLINES = Deadlines()
