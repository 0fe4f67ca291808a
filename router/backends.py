"""Engines as the router sees them: one pooled HTTP session, scraped load and ejection state."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from router.decide import fit_itl_slope
from router.engine_metrics import (
    UNAVAILABLE,
    DeviceLoad,
    EngineSample,
    derive_load,
    parse_metrics_text,
)
from router.rawhttp import RawPool

log = logging.getLogger("syshax.router")

EJECT_AFTER_ERRORS = 3
EJECT_BASE_SECONDS = 1.0
EJECT_MAX_SECONDS = 30.0


@dataclass(frozen=True)
class Timeouts:
    connect: float = 3.0
    first_byte: float = 120.0
    idle: float = 30.0
    eject_base: float = EJECT_BASE_SECONDS


def ejection_seconds(ejection_count: int, base: float = EJECT_BASE_SECONDS) -> float:
    """Back-off for the n-th ejection (0-based): 1 s, 2 s, 4 s ... capped at 30 s."""
    return float(min(EJECT_MAX_SECONDS, base * (2**ejection_count)))


class Backend:
    """One engine endpoint. ``role`` is ``gpu`` or ``cpu``."""

    def __init__(self, url: str, role: str, timeouts: Timeouts) -> None:
        self.url = url.rstrip("/")
        self.role = role
        self.timeouts = timeouts
        self.session: aiohttp.ClientSession | None = None
        # The passthrough path's lean client; PD calls use the aiohttp session.
        self.pool = RawPool(self.url, timeouts.connect)
        self.up = True  # optimistic until the first scrape says otherwise
        self.inflight = 0  # sequences this router currently has on the engine
        self.consecutive_errors = 0
        self.ejection_count = 0
        self.ejected_until = 0.0
        self.sample: EngineSample | None = None
        self.throughput_tps = 0.0
        self.itl_ms: float | None = None
        self.itl_samples: deque[tuple[float, float]] = deque(maxlen=30)
        self.itl_slope_ms: float | None = None

    def open(self) -> None:
        if self.session is None:
            # One pooled connector per engine; no per-request client.
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
            self.session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.timeouts.connect, sock_read=None
                ),
                auto_decompress=False,
                # Engines set no cookies; skipping the jar saves work on every request.
                cookie_jar=aiohttp.DummyCookieJar(),
            )

    async def close(self) -> None:
        self.pool.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    def available(self, now: float) -> bool:
        return self.up and now >= self.ejected_until

    def load(self, now: float) -> DeviceLoad:
        if not self.available(now):
            return UNAVAILABLE
        sample = self.sample
        scraped_running = int(sample.running) if sample else 0
        return DeviceLoad(
            available=True,
            # Between scrapes the router's own count is fresher than the engine's gauge.
            running=max(scraped_running, self.inflight),
            waiting=int(sample.waiting) if sample else 0,
            kv_usage_perc=100.0 * sample.kv_usage if sample else 0.0,
            throughput_tps=self.throughput_tps,
            itl_ms=self.itl_ms,
        )

    def record_success(self) -> None:
        self.consecutive_errors = 0
        self.up = True

    def record_failure(self, now: float, *, connect_failed: bool, may_eject: bool) -> bool:
        """Count an error; returns True when this error ejected the backend."""
        self.consecutive_errors += 1
        if connect_failed:
            # A refused connection is certain; do not wait for the next scrape to notice.
            self.up = False
        if (
            self.consecutive_errors >= EJECT_AFTER_ERRORS
            and may_eject
            and now >= self.ejected_until
        ):
            self.ejected_until = now + ejection_seconds(
                self.ejection_count, self.timeouts.eject_base
            )
            self.ejection_count += 1
            self.consecutive_errors = 0
            log.warning(
                "ejected %s backend %s until +%.0fs", self.role, self.url, self.ejected_until - now
            )
            return True
        return False

    async def scrape(self) -> None:
        assert self.session is not None
        try:
            async with self.session.get(
                self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2.0)
            ) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message="metrics"
                    )
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            if self.up:
                log.warning("%s backend %s is down (metrics scrape failed)", self.role, self.url)
            self.up = False
            self.sample = None
            return
        sample = parse_metrics_text(text, time.monotonic())
        self.throughput_tps, self.itl_ms = derive_load(self.sample, sample, self.itl_ms)
        if self.itl_ms is not None and sample.running > 0:
            self.itl_samples.append((sample.running, self.itl_ms))
            self.itl_slope_ms = fit_itl_slope(list(self.itl_samples))
        self.sample = sample
        if not self.up:
            log.info("%s backend %s is up again", self.role, self.url)
        self.up = True


async def scrape_forever(
    backends: Callable[[], list[Backend]], interval: Callable[[], float]
) -> None:
    """Scrape every backend each ``interval()`` seconds, concurrently, forever.

    Both are callables so a new deployment set or a changed policy interval takes effect
    on the next round without restarting the loop.
    """
    while True:
        started = time.monotonic()
        await asyncio.gather(*(b.scrape() for b in backends()), return_exceptions=True)
        await asyncio.sleep(max(0.05, interval() - (time.monotonic() - started)))
