"""The background scrape of every engine's ``/metrics``: where the deciders' load comes from.

Each ``metrics_interval_seconds`` every backend is scraped once, concurrently, over its own
connection pool; never per request. What a scrape reads goes into the backend
(``Backend.scrape_succeeded``); a failed one is classified by ``kind`` (the label of
``syshax_router_scrape_failures_total``): only ``timeout`` and ``parse`` leave the engine
routable (stale), the others mark it down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from router.engines.backends import Backend
from router.engines.load import parse_metrics_text
from router.engines.transport import UpstreamFailed, request

# Why a scrape failed, the ``kind`` label of ``syshax_router_scrape_failures_total``.
SCRAPE_TIMEOUT = "timeout"
SCRAPE_CONNECT = "connect"
SCRAPE_HTTP = "http"
SCRAPE_PARSE = "parse"
SCRAPE_FAILURE_KINDS = (SCRAPE_TIMEOUT, SCRAPE_CONNECT, SCRAPE_HTTP, SCRAPE_PARSE)
# The engine answered, or is too busy to answer in time: it is alive, only its load is
# unknown for now. The other kinds mean nothing (or the wrong thing) answers on that URL.
_STALE_KINDS = frozenset({SCRAPE_TIMEOUT, SCRAPE_PARSE})


def scrape_failure_kind(exc: BaseException) -> str:
    """Classify a failed scrape: only ``timeout`` and ``parse`` leave the backend up."""
    if isinstance(exc, UpstreamFailed):
        if exc.connect_failed:
            # The kernel completes TCP handshakes however busy the engine is: a host that
            # does not (in time) is unreachable, like a refused connection.
            return SCRAPE_CONNECT
        if exc.timed_out:
            return SCRAPE_TIMEOUT
        if exc.status is not None:
            return SCRAPE_HTTP
        return SCRAPE_CONNECT  # the connection broke: something else answers on that URL
    if isinstance(exc, ValueError):  # UnicodeDecodeError: not a Prometheus text page
        return SCRAPE_PARSE
    return SCRAPE_CONNECT


async def scrape(backend: Backend, interval: float | None = None) -> None:
    """Scrape one engine's ``/metrics`` into ``backend``; ``interval`` is the scrape loop's
    current period (for the age past which its sample is no longer used)."""
    pool = backend.pool
    if pool.closed:
        return  # left the deployment set (closed with it, or about to be)
    if interval is not None:
        backend.scrape_interval = interval
    started = time.monotonic()
    try:
        # One deadline for the whole scrape, connect included.
        async with request(
            pool,
            "/metrics",
            first_byte=backend.timeouts.scrape,
            method=b"GET",
            headers=b"",
            idle=None,
        ) as resp:
            body = await resp.read_all()
            if resp.status != 200:
                raise UpstreamFailed(pool, f"HTTP {resp.status}", status=resp.status)
        # Prometheus text is UTF-8 by definition; anything else is not a metrics page.
        text = body.decode()
    except (UpstreamFailed, ValueError) as exc:
        kind = scrape_failure_kind(exc)
        backend.scrape_failed(kind, _detail(backend, kind, exc), alive=kind in _STALE_KINDS)
        return
    now = time.monotonic()
    backend.scrape_succeeded(parse_metrics_text(text, now), started, now)


def _detail(backend: Backend, kind: str, exc: BaseException) -> str:
    """What went wrong, for ``/health``'s ``scrape.error``."""
    if kind == SCRAPE_TIMEOUT:
        return f"no answer within {backend.timeouts.scrape:g}s"
    if isinstance(exc, UpstreamFailed) and exc.status is not None:
        return f"HTTP {exc.status}"
    if isinstance(exc, UpstreamFailed):
        return exc.detail
    return str(exc) or exc.__class__.__name__


async def scrape_forever(
    backends: Callable[[], list[Backend]], interval: Callable[[], float]
) -> None:
    """Scrape every backend each ``interval()`` seconds, concurrently, forever.

    Both are callables so a new deployment set or a changed policy interval takes effect
    on the next round without restarting the loop.
    """
    while True:
        started = time.monotonic()
        period = interval()
        await asyncio.gather(*(scrape(b, period) for b in backends()), return_exceptions=True)
        await asyncio.sleep(max(0.05, period - (time.monotonic() - started)))
