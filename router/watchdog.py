"""One ticker that closes upstream streams which stay silent past their deadline."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Closeable(Protocol):
    def close(self) -> None: ...


class CancelTask:
    """Makes a task's deadline a watch: "closing" it cancels the task."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task

    def close(self) -> None:
        self.task.cancel()


class _Watch:
    __slots__ = ("deadline", "fired", "resp")

    def __init__(self, resp: Closeable, deadline: float) -> None:
        self.resp = resp
        self.deadline = deadline
        self.fired = False


class Watchdog:
    """Closes upstream streams that stay silent past their deadline.

    One 100 ms ticker serves every stream, so a read costs an attribute store instead of
    arming and cancelling a timer per token.
    """

    TICK = 0.1

    def __init__(self) -> None:
        self.active: set[_Watch] = set()
        self.task: asyncio.Task[None] | None = None

    def watch(self, resp: Closeable, deadline: float) -> _Watch:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        watch = _Watch(resp, deadline)
        self.active.add(watch)
        return watch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.TICK)
            now = loop.time()
            for watch in [w for w in self.active if now > w.deadline]:
                watch.fired = True
                self.active.discard(watch)
                watch.resp.close()


WATCHDOG = Watchdog()
