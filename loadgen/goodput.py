"""Goodput at SLO: request-rate sweeps, SLO attainment and the search for max goodput.

DistServe's measure: a run at one request rate *meets the target* when at least ``target``
percent of its requests met every SLO (TTFT, TPOT, end to end). A mode's **max goodput** is
the highest rate that meets it. :class:`GoodputSearch` finds that rate from a sweep of
ascending rates, then narrows the step between the last rate that met the target and the
first that did not by bisection. It does no I/O: the caller measures the rate it is given
and hands the result back, so the live benchmark (async, over HTTP) and the virtual-time
model (``hetero``) share one search.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

DEFAULT_ATTAINMENT = 90.0
MAX_RATES = 64
# Bisection stops after this many extra rates, or when the step is this fraction of the rate.
DEFAULT_BISECTIONS = 4
BISECTION_TOLERANCE = 0.05


def parse_rates(text: str, flag: str = "--request-rate") -> tuple[float, ...]:
    """``4``, ``inf`` or an ascending list ``1,2,4,8`` of positive requests/s.

    A list must be strictly ascending: a sweep is read left to right, and the search for the
    max goodput relies on it. ``inf`` (closed loop at the concurrency) is allowed only alone.
    """
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ValueError(f"{flag}: empty item in {text!r}")
    rates: list[float] = []
    for item in items:
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not a number") from None
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"{flag}: every rate must be positive, got {item}")
        rates.append(rate)
    if len(rates) > 1:
        if any(math.isinf(rate) for rate in rates):
            raise ValueError(f"{flag}: inf (closed loop) cannot be part of a sweep")
        for low, high in itertools.pairwise(rates):
            if high <= low:
                raise ValueError(
                    f"{flag}: rates must be strictly ascending, got {high:g} after {low:g}"
                )
    if len(rates) > MAX_RATES:
        raise ValueError(f"{flag}: at most {MAX_RATES} rates, got {len(rates)}")
    return tuple(rates)


def check_attainment(value: float, flag: str = "--slo-attainment") -> float:
    if math.isnan(value) or not 0 < value <= 100:
        raise ValueError(f"{flag} must be in (0, 100] percent, got {value:g}")
    return value


@dataclass(frozen=True)
class RatePoint:
    """One mode at one offered request rate."""

    rate: float
    requests: int
    good: int
    duration_s: float
    output_tokens: int
    bisection: bool = False  # measured by the search rather than listed in the sweep

    @property
    def attainment(self) -> float:
        """Percent of the requests that succeeded and met every SLO."""
        return 100.0 * self.good / self.requests if self.requests else 0.0

    @property
    def goodput(self) -> float:
        """Requests/s that met every SLO, per second of offered load: rate x attainment.

        The requests arrive over exactly ``requests / rate`` seconds (``arrival_offsets``),
        so this is the good requests over the time the load was offered. vLLM's figure
        divides by the run's whole duration instead, drain included (``drained_goodput``):
        a finite run then charges a mode for its slowest last request, which says nothing
        about the load it sustains.
        """
        return self.rate * self.attainment / 100.0

    @property
    def drained_goodput(self) -> float:
        """vLLM's definition: good requests over the run's duration, drain included."""
        return self.good / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def throughput(self) -> float:
        """Output tokens/s, SLO or not."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "attainment": self.attainment,
            "goodput": self.goodput,
            "drained_goodput": self.drained_goodput,
            "throughput": self.throughput,
        }


@dataclass
class GoodputSearch:
    """The sweep of one mode, and where its max goodput lies.

    Call :meth:`next_rate` for the rate to measure next and :meth:`record` with what was
    measured, until :meth:`next_rate` returns None. Every listed rate is measured (the chart
    needs them all); with ``bisections`` > 0 the search then measures rates between the last
    listed rate that met the target and the first listed rate after it that did not.
    """

    rates: Sequence[float]
    target: float = DEFAULT_ATTAINMENT
    bisections: int = 0
    points: list[RatePoint] = field(default_factory=list)
    _bisected: int = 0

    def __post_init__(self) -> None:
        check_attainment(self.target)
        if not self.rates:
            raise ValueError("a sweep needs at least one rate")

    def meets(self, point: RatePoint) -> bool:
        return point.attainment >= self.target

    def record(self, point: RatePoint) -> None:
        self.points.append(point)
        self.points.sort(key=lambda p: p.rate)

    def next_rate(self) -> float | None:
        measured = {point.rate for point in self.points}
        for rate in self.rates:
            if rate not in measured:
                return rate
        if self._bisected >= self.bisections:
            return None
        low, high = self.bracket()
        if low is None or high is None or (high.rate - low.rate) <= BISECTION_TOLERANCE * high.rate:
            return None
        self._bisected += 1
        return (low.rate + high.rate) / 2

    def bracket(self) -> tuple[RatePoint | None, RatePoint | None]:
        """The highest rate that met the target with every lower rate meeting it too, and
        the lowest rate above it that missed (None where there is none)."""
        low: RatePoint | None = None
        for point in self.points:
            if not self.meets(point):
                return low, point
            low = point
        return low, None

    @property
    def max_goodput_rate(self) -> float | None:
        """The highest rate meeting the target below the first that missed; None if none did."""
        low, _ = self.bracket()
        return low.rate if low is not None else None

    @property
    def saturated(self) -> bool:
        """Whether some rate missed the target (so the max goodput is bounded, not open)."""
        return self.bracket()[1] is not None

    @property
    def best_attainment(self) -> float:
        return max((point.attainment for point in self.points), default=0.0)

    def verdict(self) -> str:
        """One line: the max goodput, or why there is none."""
        rate = self.max_goodput_rate
        if rate is None:
            return (
                f"no rate met the {self.target:g}% target "
                f"(best attainment {self.best_attainment:.1f}%)"
            )
        if not self.saturated:
            return f"every rate met the {self.target:g}% target: max goodput is at least {rate:g}"
        return f"max goodput {rate:g} req/s at {self.target:g}% attainment"

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> GoodputSearch:
        """A search back from :meth:`to_dict` (a stored run's ``sweeps``); raises ValueError
        (or KeyError / TypeError) for a document that is not one."""
        target = data.get("target", DEFAULT_ATTAINMENT)
        points = data.get("points")
        if not isinstance(target, int | float) or not isinstance(points, list):
            raise ValueError("a sweep needs a numeric target and a list of points")
        parsed = [
            RatePoint(
                rate=float(p["rate"]),
                requests=int(p["requests"]),
                good=int(p["good"]),
                duration_s=float(p["duration_s"]),
                output_tokens=int(p["output_tokens"]),
                bisection=bool(p.get("bisection", False)),
            )
            for p in points
            if isinstance(p, dict)
        ]
        listed = tuple(p.rate for p in parsed if not p.bisection) or tuple(p.rate for p in parsed)
        search = cls(listed, target=float(target))  # no points: ValueError, as documented
        for point in parsed:
            search.record(point)
        return search

    def goodput_at(self, rate: float) -> float | None:
        for point in self.points:
            if point.rate == rate:
                return point.goodput
        return None

    def to_dict(self) -> dict[str, object]:
        return {
            "target": self.target,
            "max_goodput_rate": self.max_goodput_rate,
            "saturated": self.saturated,
            "best_attainment": self.best_attainment,
            "points": [point.to_dict() for point in self.points],
        }


def format_sweeps(searches: dict[str, GoodputSearch]) -> str:
    """A Markdown table, one line per (mode, rate), then each mode's max goodput."""
    lines = [
        "| mode | rate (req/s) | requests | SLO attainment | goodput (req/s) "
        "| throughput (tok/s) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, search in searches.items():
        for point in search.points:
            mark = " (bisection)" if point.bisection else ""
            lines.append(
                f"| {mode} | {point.rate:g}{mark} | {point.requests} | "
                f"{point.attainment:.1f}% | {point.goodput:.2f} | {point.throughput:,.1f} |"
            )
    lines.append("")
    for mode, search in searches.items():
        lines.append(f"{mode}: {search.verdict()}")
    return "\n".join(lines)


def ratio_line(searches: dict[str, GoodputSearch], mode: str, baseline: str) -> str | None:
    """``hetero max goodput / gpu max goodput = 1.23x``, where both were found."""
    if mode not in searches or baseline not in searches:
        return None
    top, base = searches[mode].max_goodput_rate, searches[baseline].max_goodput_rate
    if top is None or not base:
        return None
    return f"{mode} / {baseline} max goodput: {top / base:.2f}x"
