"""Counters, histograms and the recent-request ring that the engine keeps.

Kept as plain Python objects (not prometheus_client metrics) because the engine updates them
for every token of every stream; ``metrics.py`` renders them at scrape time.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.scheduler import Sequence

# vLLM's own bucket boundaries (vllm/v1/metrics/loggers.py and the 0.4 series).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
THROUGHPUT_WINDOW_S = 5.0  # vLLM 0.4's stats log interval, over which avg_*_throughput ran


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def bounded_cumulative(self) -> tuple[tuple[float, float], ...]:
        """(upper bound, cumulative count) of every bucket, +Inf last: as a scrape reads it."""
        out = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((float(bound), float(running)))
        out.append((float("inf"), float(self.count)))
        return tuple(out)

    def cumulative(self) -> list[tuple[str, float]]:
        """(the ``le`` label, cumulative count) of every bucket, as Prometheus prints them."""
        return [
            ("+Inf" if bound == float("inf") else repr(bound), n)
            for bound, n in self.bounded_cumulative()
        ]


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0  # every prompt token, computed or cached (vLLM's counting)
    generation_tokens_total: int = 0
    # vLLM's prefix-cache counters, in tokens: the local prefix cache (queried for every
    # prompt while it is on), and "external", the KV connector (queried for every request
    # when one is configured, hit by the tokens it loaded beyond the local hits).
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    external_prefix_cache_queries_total: int = 0
    external_prefix_cache_hits_total: int = 0
    prompt_tokens_cached_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # (sim time, prompt tokens, generation tokens) per step, for the legacy averages
    recent_steps: deque[tuple[float, int, int]] = field(default_factory=deque)

    def count_prompt(self, seq: Sequence) -> None:
        """A sequence's prompt, once its first token is out."""
        context = seq.prompt_tokens + seq.resumed_tokens
        self.prompt_tokens_total += context
        if seq.hasher is not None:
            self.prefix_cache_queries_total += context
            self.prefix_cache_hits_total += seq.cache_hits
        self.prompt_tokens_cached_total += seq.cache_hits
        if seq.connector_queried:
            self.external_prefix_cache_queries_total += context
            self.external_prefix_cache_hits_total += seq.connector_hits
            self.prompt_tokens_cached_total += seq.connector_hits

    def record_step(self, now: float, prompt_tokens: int, generation_tokens: int) -> None:
        self.recent_steps.append((now, prompt_tokens, generation_tokens))
        horizon = now - THROUGHPUT_WINDOW_S
        while self.recent_steps and self.recent_steps[0][0] < horizon:
            self.recent_steps.popleft()

    def throughputs(self, now: float) -> tuple[float, float]:
        """(prompt, generation) tokens per simulated second over the last window."""
        horizon = now - THROUGHPUT_WINDOW_S
        prompt = sum(p for t, p, _ in self.recent_steps if t >= horizon)
        generation = sum(g for t, _, g in self.recent_steps if t >= horizon)
        span = min(THROUGHPUT_WINDOW_S, max(now, 1e-9))
        return prompt / span, generation / span


class BusyMeter:
    """Simulated seconds the device spent executing engine steps (prefill, decode, swaps).

    A step counts from its modelled start; one still running counts up to ``now``, so a reading
    taken in the middle of a long prefill is exact rather than a whole step early or late.
    """

    def __init__(self) -> None:
        self.done = 0.0
        self._start = 0.0
        self._end: float | None = None  # the running step's end, None between steps

    def begin(self, start: float, end: float) -> None:
        self._start, self._end = start, end

    def finish(self) -> None:
        if self._end is not None:
            self.done += self._end - self._start
            self._end = None

    def busy_at(self, now: float) -> float:
        if self._end is None:
            return self.done
        return self.done + max(0.0, min(now, self._end) - self._start)


class RequestRing:
    """The last ``size`` finished requests with their own timings (epoch seconds)."""

    def __init__(self, size: int) -> None:
        self.items: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, item: dict[str, Any]) -> None:
        self.items.append(item)

    def snapshot(self) -> list[dict[str, Any]]:
        return list(self.items)
