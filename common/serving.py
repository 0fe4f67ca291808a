"""The serving figures a router reports with its stats (``serving``), and their one validator.

A router reports, every stats interval, what happened since its previous report: the
decisions it made (by route, and by route and reason), its requests' TTFT and its engines'
inter-token latency (TPOT) as histograms, and what it last scraped of each engine (running
and waiting sequences, KV-cache use, tokens/s, mean ITL), per deployment. Histograms are
``{upper bound in ms: count}`` with the bound written as :func:`bucket_key` writes it and
``"+Inf"`` for the last; they add up across reports and routers, so any window's percentiles
come from their sum (:func:`quantile_ms`). The control plane's serializer and its machine
gateway both call :func:`clean_serving`, so they take exactly the same reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

ROLES = ("gpu", "cpu")
MAX_DEPLOYMENTS = 256
MAX_ENGINES = 8
MAX_KEYS = 64  # histogram bounds, decision routes, reasons
MAX_TEXT = 200
MAX_ID = 2**53
# What one report could hold: a count (of requests, sequences, histogram observations) over
# one interval, and each measure, far above any real engine or router and far below what
# would make their sums across engines and routers overflow (docs/decisions/0057-router-
# credential-scope-and-usage-bounds.md). A report beyond them is refused at the door.
MAX_COUNT = 10**9
DAY_MS = 86_400_000.0
MEASURE_LIMITS = {
    "kv_usage_perc": 100.0,  # percent of the KV cache
    "tokens_per_second": 1e7,
    "itl_ms": DAY_MS,
    "interval_seconds": 86_400.0,
}
# What no JSON column keeps (NUL, lone surrogates): refused as the control plane's parser does.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class ServingError(ValueError):
    """A serving report that does not have the documented shape."""


def bucket_key(bound_ms: float) -> str:
    return "+Inf" if math.isinf(bound_ms) else format(round(bound_ms, 6), "g")


def add_histograms(into: dict[str, int], other: Mapping[str, int]) -> dict[str, int]:
    for key, count in other.items():
        into[key] = into.get(key, 0) + count
    return into


def histogram_count(histogram: Mapping[str, int]) -> int:
    return sum(histogram.values())


def quantile_ms(histogram: Mapping[str, int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram, linear within the bucket that holds it (as
    Prometheus' ``histogram_quantile``); past the last finite bound, that bound. None when
    the histogram is empty."""
    buckets = sorted((float(key), count) for key, count in histogram.items() if count > 0)
    total = sum(count for _, count in buckets)
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0
    for bound, count in buckets:
        if below + count >= rank:
            if math.isinf(bound):
                return lower
            share = (rank - below) / count if count else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, below + count
    return lower


def histogram_from_cumulative(
    now: Iterable[tuple[float, float]], before: Iterable[tuple[float, float]] | None
) -> dict[str, int]:
    """Per-bucket counts (ms keys) between two cumulative Prometheus histograms with bounds
    in seconds; empty when the bounds differ or a count went down (a restarted engine)."""
    current = list(now)
    previous = list(before) if before is not None else [(bound, 0.0) for bound, _ in current]
    if len(current) != len(previous):
        return {}
    out: dict[str, int] = {}
    below_now = below_before = 0.0
    for (bound, cum), (bound_before, cum_before) in zip(current, previous, strict=True):
        if bound != bound_before or cum < cum_before:
            return {}
        count = round((cum - below_now) - (cum_before - below_before))
        below_now, below_before = cum, cum_before
        if count > 0:
            out[bucket_key(1000.0 * bound)] = count
    return out


# -- the validator ------------------------------------------------------------------------------


def _text(value: Any, where: str) -> str:
    if type(value) is not str or not value or len(value) > MAX_TEXT or _UNSTORABLE.search(value):
        raise ServingError(f"{where}: a non-empty string of at most {MAX_TEXT} characters")
    return value


def _count(value: Any, where: str, limit: int = MAX_COUNT) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise ServingError(f"{where}: a count (an integer, 0 to {limit})")
    return value


def _measure(value: Any, where: str, limit: float, *, nullable: bool = True) -> float | None:
    if value is None and nullable:
        return None
    if type(value) not in (int, float):
        raise ServingError(f"{where}: a number, 0 or more{' (or null)' if nullable else ''}")
    try:
        number = float(value)
    except OverflowError:
        raise ServingError(f"{where}: a finite number") from None
    if not math.isfinite(number) or not 0 <= number <= limit:
        raise ServingError(f"{where}: a number, 0 to {limit:g}")
    return number


def _object(value: Any, where: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise ServingError(f"{where}: an object")
    return value


def _tally(value: Any, where: str) -> dict[str, int]:
    value = _object(value, where)
    if len(value) > MAX_KEYS:
        raise ServingError(f"{where}: at most {MAX_KEYS} entries")
    return {_text(k, where): _count(v, f"{where}.{k}") for k, v in value.items()}


def _histogram(value: Any, where: str) -> dict[str, int]:
    tally = _tally(value, where)
    for key in tally:
        try:
            bound = float(key)
        except ValueError:
            raise ServingError(f"{where}: bucket {key!r} is not a bound in ms") from None
        if math.isnan(bound) or bound <= 0:
            raise ServingError(f"{where}: bucket {key!r} is not a positive bound")
        if DAY_MS < bound < math.inf:
            raise ServingError(f"{where}: bucket {key!r} is past a day (+Inf is the last)")
    return tally


def _engine(value: Any, where: str) -> dict[str, Any]:
    engine = _object(value, where)
    role = engine.get("role")
    if role not in ROLES:
        raise ServingError(f"{where}.role: one of {', '.join(ROLES)}")
    up = engine.get("up", True)
    if type(up) is not bool:
        raise ServingError(f"{where}.up: true or false")
    out: dict[str, Any] = {"role": role, "url": _text(engine.get("url"), f"{where}.url"), "up": up}
    for name in ("running", "waiting"):
        count = engine.get(name)
        out[name] = None if count is None else _count(count, f"{where}.{name}")
    for name in ("kv_usage_perc", "tokens_per_second", "itl_ms"):
        out[name] = _measure(engine.get(name), f"{where}.{name}", MEASURE_LIMITS[name])
    return out


def _deployment(value: Any, where: str) -> dict[str, Any]:
    d = _object(value, where)
    engines = d.get("engines", [])
    if type(engines) is not list or len(engines) > MAX_ENGINES:
        raise ServingError(f"{where}.engines: a list of at most {MAX_ENGINES}")
    return {
        "id": _count(d.get("id"), f"{where}.id", MAX_ID),
        "name": _text(d.get("name"), f"{where}.name"),
        "model": _text(d.get("model"), f"{where}.model"),
        "decisions": _tally(d.get("decisions", {}), f"{where}.decisions"),
        "ttft_ms": _histogram(d.get("ttft_ms", {}), f"{where}.ttft_ms"),
        "tpot_ms": _histogram(d.get("tpot_ms", {}), f"{where}.tpot_ms"),
        "engines": [_engine(e, f"{where}.engines[{i}]") for i, e in enumerate(engines)],
    }


def clean_serving(value: Any) -> dict[str, Any]:
    """The serving report as stored, or :class:`ServingError` naming what is wrong. An empty
    object (a router older than these figures) is taken as it is."""
    serving = _object(value, "serving")
    if not serving:
        return {}
    deployments = serving.get("deployments", [])
    if type(deployments) is not list or len(deployments) > MAX_DEPLOYMENTS:
        raise ServingError(f"serving.deployments: a list of at most {MAX_DEPLOYMENTS}")
    return {
        "interval_seconds": _measure(
            serving.get("interval_seconds"),
            "serving.interval_seconds",
            MEASURE_LIMITS["interval_seconds"],
            nullable=False,
        ),
        "decisions": _tally(serving.get("decisions", {}), "serving.decisions"),
        "reasons": _tally(serving.get("reasons", {}), "serving.reasons"),
        "ttft_ms": _histogram(serving.get("ttft_ms", {}), "serving.ttft_ms"),
        "tpot_ms": _histogram(serving.get("tpot_ms", {}), "serving.tpot_ms"),
        "deployments": [
            _deployment(d, f"serving.deployments[{i}]") for i, d in enumerate(deployments)
        ],
    }
