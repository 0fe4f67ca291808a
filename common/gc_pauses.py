"""Garbage-collector pauses, timed: while a collection runs, nothing else in the process does.

Both the machine gateway (its event loop's longest stall, in its 30 s report) and the fleet
load generator (its own pauses, which it would otherwise time as the control plane's
latency) register one :class:`CollectionTimes` in ``gc.callbacks``
(docs/decisions/0033-gateway-backlog-and-frozen-heap.md,
docs/decisions/0035-fleet-load-generator-share.md).
"""

from __future__ import annotations

import gc
import time


class CollectionTimes:
    """A ``gc.callbacks`` entry: the longest collection since :meth:`take_longest`, and,
    with ``keep_over``, each collection longer than that many seconds."""

    def __init__(self, keep_over: float | None = None) -> None:
        self.keep_over = keep_over
        self.longest = 0.0
        self.long: list[tuple[float, float, int]] = []  # (time.time(), seconds, generation)
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.longest = max(self.longest, took)
        if self.keep_over is not None and took > self.keep_over:
            self.long.append((time.time(), took, info["generation"]))

    def take_longest(self) -> float:
        """The longest since the last call, and start again."""
        longest, self.longest = self.longest, 0.0
        return longest


def freeze_heap() -> None:
    """Collect once, then leave everything alive now out of every later collection: what a
    long-running process built at start-up is never garbage, yet each full collection would
    walk all of it."""
    gc.collect()
    gc.freeze()
