"""A machine gateway (controlplane/gateway) on its own event loop thread, for tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from common.supervisor import free_port
from controlplane.gateway.server import Gateway


@dataclass
class Running:
    url: str
    gateway: Gateway
    loop: asyncio.AbstractEventLoop

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def call(self, fn: Any) -> Any:
        """Run ``fn`` in the gateway's loop and return what it returns."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


@contextmanager
def serving_gateway(upstream: str, *, snapshot: bool = True, **options: Any) -> Iterator[Running]:
    """A gateway in front of the control plane at ``upstream``, once it has its first
    snapshot (with ``snapshot``); ``options`` go to :class:`Gateway` (a 0.1 s snapshot
    interval by default)."""
    gw = Gateway(upstream, **{"snapshot_interval": 0.1, **options})
    loop = asyncio.new_event_loop()
    port = free_port()
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(gw.start("127.0.0.1", port))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=main, name="gateway", daemon=True)
    thread.start()
    assert started.wait(30)
    deadline = time.monotonic() + 30
    while snapshot and gw.watcher.current() is None:
        assert time.monotonic() < deadline, "the gateway took no snapshot"
        time.sleep(0.05)
    try:
        yield Running(f"http://127.0.0.1:{port}", gw, loop)
    finally:
        asyncio.run_coroutine_threadsafe(gw.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
