"""Engines as the router sees them: one connection pool, scraped load and ejection state.

A ``Backend`` is one engine endpoint. It holds what the scrapes said (``router.engines.scrape``
does the scraping), the requests the router has on it, and its errors towards ejection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from router.engines.load import UNAVAILABLE, DeviceLoad, EngineSample, LoadTracker
from router.engines.transport import EnginePool

log = logging.getLogger("syshax.router")

EJECT_AFTER_ERRORS = 3
EJECT_BASE_SECONDS = 1.0
EJECT_MAX_SECONDS = 30.0
# A stale sample is still used until it is older than this many scrape intervals (and at
# least ``Timeouts.sample_max_age``); after that the decider sees only the in-flight count.
SAMPLE_MAX_AGE_INTERVALS = 3


@dataclass(frozen=True)
class Timeouts:
    connect: float = 3.0
    first_byte: float = 120.0
    idle: float = 30.0
    eject_base: float = EJECT_BASE_SECONDS
    # One engine /metrics scrape, connect included. Past it the backend is stale, not down.
    scrape: float = 2.0
    # The shortest age at which a stale sample stops being used (see SAMPLE_MAX_AGE_INTERVALS).
    sample_max_age: float = 10.0


@dataclass(frozen=True)
class ScrapeView:
    """What the last scrapes of one engine told the router; ``None`` means unknown."""

    running: int | None
    waiting: int | None
    kv_usage_perc: float | None
    throughput_tps: float | None
    itl_ms: float | None
    scrape_age_seconds: float | None  # since the last successful scrape
    scrape_duration_ms: float | None  # of the last successful scrape
    stale: bool
    last_error: str | None  # of the latest scrape; None when it succeeded


class InFlight(Protocol):
    """A request using a backend, as the backend sees it when it leaves the deployment set."""

    def backend_removed(self, backend: Backend) -> bool:
        """Hand the request to another engine unless it sent output; True if it was."""
        ...


def ejection_seconds(ejection_count: int, base: float = EJECT_BASE_SECONDS) -> float:
    """Back-off for the n-th ejection (0-based): 1 s, 2 s, 4 s ... capped at 30 s."""
    return float(min(EJECT_MAX_SECONDS, base * (2**ejection_count)))


class Backend(LoadTracker):
    """One engine endpoint. ``role`` is ``gpu`` or ``cpu``."""

    def __init__(self, url: str, role: str, timeouts: Timeouts) -> None:
        LoadTracker.__init__(self, role)  # the role and what the scrapes say
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        # The one client for this engine: passthrough, PD, tokenize, scrapes and the proxy.
        self.pool = EnginePool(self.url, role, timeouts.connect, timeouts.idle)
        self.closed = False  # closed after leaving the deployment set and draining
        self.up = True  # optimistic until the first scrape says otherwise
        self.inflight = 0  # sequences this router currently has on the engine
        # The requests now on the engine, for when it leaves the deployment set (retire).
        self.requests: set[InFlight] = set()
        # Made when the backend leaves the deployment set; set once its last request ended.
        self.drained: asyncio.Event | None = None
        self.consecutive_errors = 0
        self.kv_misses = 0  # consecutive PD decodes that recomputed the handed-over KV
        self.ejection_count = 0
        self.ejected_until = 0.0
        # The scrape's own record, for /health and /metrics.
        self.stale = False  # the latest scrape timed out or was unreadable; still routed to
        self.scrape_interval = 1.0  # the scrape loop's current period, for the sample's age
        self.last_scrape_ok_at: float | None = None  # monotonic
        self.last_scrape_seconds: float | None = None  # how long that scrape took
        self.last_scrape_error: str | None = None
        self.scrape_failures_in_row = 0
        self._untaken_scrape_failures: dict[str, int] = {}

    async def close(self) -> None:
        self.pool.close()
        self.closed = True

    @contextlib.contextmanager
    def holding(self, request: InFlight) -> Iterator[None]:
        """Count ``request`` as in flight on this engine while the block runs (the deciders
        and the balancer read the count; ``retire`` hands over the requests it holds)."""
        self.inflight += 1
        self.requests.add(request)
        try:
            yield
        finally:
            self.inflight -= 1
            self.requests.discard(request)
            if self.drained is not None and self.inflight <= 0:
                self.drained.set()

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Leave one held sequence out of the count while the block decides where it goes."""
        self.inflight -= 1
        try:
            yield
        finally:
            self.inflight += 1

    def retire(self) -> int:
        """The engine left the deployment set (its node was lost, or its deployment stopped).

        It takes no new requests and its idle connections close. The requests on it that
        have sent the client nothing yet are handed to another engine at once, rather than
        waiting on a host that may be silent until the first-byte timeout; returns how many.
        Streams already under way stay on it; ``drained`` is set after the last one ends."""
        self.up = False
        self.pool.close()
        self.drained = asyncio.Event()
        if self.inflight <= 0:
            self.drained.set()
        return sum(request.backend_removed(self) for request in list(self.requests))

    def available(self, now: float) -> bool:
        return self.up and now >= self.ejected_until

    def sample_max_age(self) -> float:
        return max(self.timeouts.sample_max_age, SAMPLE_MAX_AGE_INTERVALS * self.scrape_interval)

    def load(self, now: float) -> DeviceLoad:
        if not self.available(now):
            return UNAVAILABLE
        sample = self.sample
        if sample is not None and now - sample.at > self.sample_max_age():
            # Scrapes keep timing out: the last sample says too little about the engine now.
            # The router's own in-flight count is all that is left, and it stays routable.
            return DeviceLoad(True, self.inflight, 0, 0.0, 0.0, None, stale=True)
        load = self.tracked_load(self.inflight)
        # A failed latest scrape: the decider sends this engine no new decode (docs/router.md).
        return replace(load, stale=True) if self.stale else load

    def scrape_view(self, now: float) -> ScrapeView:
        sample = self.sample
        ok_at = self.last_scrape_ok_at
        duration = self.last_scrape_seconds
        return ScrapeView(
            running=int(sample.running) if sample else None,
            waiting=int(sample.waiting) if sample else None,
            kv_usage_perc=100.0 * sample.kv_usage if sample else None,
            throughput_tps=self.throughput_tps if sample else None,
            itl_ms=self.itl_ms if sample else None,
            scrape_age_seconds=now - ok_at if ok_at is not None else None,
            scrape_duration_ms=1000.0 * duration if duration is not None else None,
            # A down backend is down, whatever its last scrape said.
            stale=self.stale and self.up,
            last_error=self.last_scrape_error,
        )

    def take_scrape_failures(self) -> dict[str, int]:
        """Scrape failures by kind since the previous call (the Prometheus counter's feed)."""
        taken, self._untaken_scrape_failures = self._untaken_scrape_failures, {}
        return taken

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

    # -- what the scrapes say (router.engines.scrape) ----------------------------------------

    def scrape_succeeded(self, sample: EngineSample, started: float, now: float) -> None:
        """A scrape that began at ``started`` read ``sample``: the engine is up and fresh."""
        self.observe(sample)
        self.last_scrape_ok_at = now
        self.last_scrape_seconds = now - started
        self.last_scrape_error = None
        self.scrape_failures_in_row = 0
        if not self.up:
            log.info("%s backend %s is up again", self.role, self.url)
        elif self.stale:
            log.info("%s backend %s answers its metrics scrape again", self.role, self.url)
        self.up = True
        self.stale = False

    def scrape_failed(self, kind: str, detail: str, *, alive: bool) -> None:
        """A scrape failed (``kind``, ``detail``). ``alive``: the engine answered, or is too
        busy to answer in time, so it stays routable on its last sample (stale); otherwise
        nothing (or the wrong thing) answers on its URL and it is down."""
        self.scrape_failures_in_row += 1
        self._untaken_scrape_failures[kind] = self._untaken_scrape_failures.get(kind, 0) + 1
        self.last_scrape_error = f"{kind}: {detail}"
        if alive:
            # A busy engine is slow to answer /metrics, not gone: keep routing to it on its
            # last sample and the router's own in-flight count. A down one stays down.
            if self.up and not self.stale:
                log.warning(
                    "%s backend %s is stale (metrics scrape %s); using its last sample",
                    self.role,
                    self.url,
                    self.last_scrape_error,
                )
            self.stale = self.up
            return
        if self.up:
            log.warning(
                "%s backend %s is down (metrics scrape %s)",
                self.role,
                self.url,
                self.last_scrape_error,
            )
        self.up = False
        self.stale = False
        self.sample = None
