"""The live serving panels: routers' stats samples (their ``serving`` figures,
common/serving.py) summed over a window, for the whole fleet, one deployment or one node.

:func:`aggregate` is pure (samples in, figures out); :func:`serving_panel` reads the samples
and draws the charts. Figures a router measures itself (decisions, reasons, TTFT) add up
across routers; figures of an engine (running, waiting, KV-cache use, tokens/s, ITL) are what
each router last scraped of the same engine, so several routers' readings of one engine are
averaged, not added. The TPOT histogram of an engine scraped by several routers is counted
once by each: its percentiles are unchanged by that.

Every figure is finite by construction: each engine reading is capped at the bound the
control plane accepts (``common.serving.MEASURE_LIMITS``; a sample stored before those bounds
may hold more) before it is averaged or summed, and what :func:`aggregate` returns holds no
NaN or infinity (:func:`finite`), so ``/live/serving.json`` is always valid JSON.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from common.decisions import Route
from common.serving import MAX_COUNT, MEASURE_LIMITS, add_histograms, histogram_count, quantile_ms
from controlplane.dashboard import charts
from controlplane.routers.choices import DECISIONS
from controlplane.routers.models import RouterStatsSample


@dataclass(frozen=True)
class Window:
    key: str
    label: str
    seconds: int
    step: int  # seconds a chart point covers
    poll: int  # seconds between the page's refreshes


WINDOWS = {
    w.key: w
    for w in (
        Window("5m", "5 min", 300, 10, 5),
        Window("1h", "1 h", 3600, 60, 15),
        Window("24h", "24 h", 86400, 1200, 60),
    )
}
DEFAULT_WINDOW = "5m"

UNITS = {
    "tokens_per_second": "tokens/s",
    "ttft_p50_ms": "ms",
    "ttft_p99_ms": "ms",
    "tpot_p50_ms": "ms",
    "tpot_p99_ms": "ms",
    "itl_ms": "ms",
    "kv_usage_perc": "%",
    "running": "sequences",
    "waiting": "requests",
    "requests": "requests",
    "pd_share_percent": "% of requests",
}
ENGINE_FIGURES = ("running", "waiting", "kv_usage_perc", "tokens_per_second", "itl_ms")
# The most any one engine reading counts for: what the control plane accepts of a report.
FIGURE_LIMITS = {"running": float(MAX_COUNT), "waiting": float(MAX_COUNT), **MEASURE_LIMITS}


def capped(figure: str, value: Any) -> float | None:
    """An engine's reading as the panel counts it: a number, at most the figure's limit;
    None for what is not a finite number 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return FIGURE_LIMITS[figure]
    if math.isnan(number) or number < 0:
        return None
    if number > FIGURE_LIMITS[figure]:
        return FIGURE_LIMITS[figure]
    return value  # as reported: a count stays an integer


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts and lists) made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def window_of(key: str | None) -> Window:
    return WINDOWS.get(key or "", WINDOWS[DEFAULT_WINDOW])


def _round(value: float | None, places: int = 2) -> float | None:
    return None if value is None else round(value, places)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class _Bucket:
    """One chart point: what the samples in its step said."""

    def __init__(self) -> None:
        self.decisions: dict[str, int] = {}
        self.ttft: dict[str, int] = {}
        self.tpot: dict[str, int] = {}
        # (deployment id, role) -> figure -> readings
        self.engines: dict[tuple[int, str], dict[str, list[float]]] = {}

    def figures(self) -> dict[str, Any]:
        requests = sum(self.decisions.values())
        tps = [_mean(e["tokens_per_second"]) for e in self.engines.values()]
        known = [v for v in tps if v is not None]
        return {
            "requests": requests,
            "tokens_per_second": _round(sum(known)) if known else None,
            "ttft_p50_ms": _round(quantile_ms(self.ttft, 0.5)),
            "ttft_p99_ms": _round(quantile_ms(self.ttft, 0.99)),
            "tpot_p50_ms": _round(quantile_ms(self.tpot, 0.5)),
            "tpot_p99_ms": _round(quantile_ms(self.tpot, 0.99)),
            "pd_share_percent": _round(100.0 * self.decisions.get(Route.PD, 0) / requests)
            if requests
            else None,
        }


def _scoped(
    serving: Mapping[str, Any], deployments: Collection[int] | None
) -> tuple[dict[str, int], dict[str, int], dict[str, int], list[dict[str, Any]]]:
    """A sample's decisions, TTFT, TPOT and deployment entries within the scope (None: the
    fleet, from the report's totals). A model's figures count once per sample even when two
    of its deployments are in scope (the router counts requests by model)."""
    entries = [
        d
        for d in serving.get("deployments", [])
        if deployments is None or d.get("id") in deployments
    ]
    if deployments is None:
        return (
            dict(serving.get("decisions", {})),
            dict(serving.get("ttft_ms", {})),
            dict(serving.get("tpot_ms", {})),
            entries,
        )
    decisions: dict[str, int] = {}
    ttft: dict[str, int] = {}
    tpot: dict[str, int] = {}
    models: set[str] = set()
    for d in entries:
        add_histograms(tpot, d.get("tpot_ms", {}))
        if d.get("model") in models:
            continue
        models.add(d.get("model", ""))
        add_histograms(decisions, d.get("decisions", {}))
        add_histograms(ttft, d.get("ttft_ms", {}))
    return decisions, ttft, tpot, entries


def aggregate(
    samples: Iterable[tuple[datetime, Mapping[str, Any]]],
    *,
    now: datetime,
    window: Window,
    deployments: Collection[int] | None = None,
) -> dict[str, Any]:
    """The panel's figures over ``window`` ending at ``now``: one point a step (x in seconds
    before now), the engines' latest readings, and the window's totals."""
    start = now - timedelta(seconds=window.seconds)
    count = window.seconds // window.step
    buckets = [_Bucket() for _ in range(count)]
    decisions: dict[str, int] = {}
    reasons: dict[str, int] = {}
    ttft: dict[str, int] = {}
    tpot: dict[str, int] = {}
    latest: dict[tuple[int, str], tuple[datetime, dict[str, Any], str]] = {}
    for received_at, serving in samples:
        if not serving or received_at < start or received_at > now:
            continue
        index = min(count - 1, int((received_at - start).total_seconds() // window.step))
        bucket = buckets[index]
        d_decisions, d_ttft, d_tpot, entries = _scoped(serving, deployments)
        add_histograms(bucket.decisions, d_decisions)
        add_histograms(bucket.ttft, d_ttft)
        add_histograms(bucket.tpot, d_tpot)
        add_histograms(decisions, d_decisions)
        add_histograms(ttft, d_ttft)
        add_histograms(tpot, d_tpot)
        if deployments is None:
            add_histograms(reasons, serving.get("reasons", {}))
        for entry in entries:
            for engine in entry.get("engines", []):
                key = (entry["id"], engine["role"])
                readings = bucket.engines.setdefault(key, {f: [] for f in ENGINE_FIGURES})
                for figure in ENGINE_FIGURES:
                    reading = capped(figure, engine.get(figure))
                    if reading is not None:
                        readings[figure].append(reading)
                if key not in latest or latest[key][0] <= received_at:
                    latest[key] = (received_at, engine, entry["name"])
    points = []
    for i, bucket in enumerate(buckets):
        at = start + timedelta(seconds=(i + 1) * window.step)
        points.append({"x": -(now - at).total_seconds(), "t": at.isoformat(), **bucket.figures()})
    engine_series = []
    for (deployment_id, role), (at, engine, name) in sorted(latest.items()):
        series = []
        for i, bucket in enumerate(buckets):
            found = bucket.engines.get((deployment_id, role))
            series.append(
                {
                    "x": points[i]["x"],
                    **{f: _round(_mean(found[f])) if found else None for f in ENGINE_FIGURES},
                }
            )
        engine_series.append(
            {
                "deployment_id": deployment_id,
                "deployment": name,
                "role": role,
                "url": engine["url"],
                "up": engine["up"],
                "seen_at": at.isoformat(),
                "latest": {f: capped(f, engine.get(f)) for f in ENGINE_FIGURES},
                "points": series,
            }
        )
    requests = sum(decisions.values())
    served = {key: decisions.get(key, 0) for key in DECISIONS}
    current = next(
        (p["tokens_per_second"] for p in reversed(points) if p["tokens_per_second"] is not None),
        None,
    )
    return finite(
        {
            "window": window.key,
            "window_label": window.label,
            "seconds": window.seconds,
            "step_seconds": window.step,
            "poll_seconds": window.poll,
            "units": UNITS,
            "points": points,
            "engines": engine_series,
            "summary": {
                "requests": requests,
                "decisions": served,
                "pd_share_percent": _round(100.0 * decisions.get(Route.PD, 0) / requests)
                if requests
                else None,
                "tokens_per_second": current,
                "ttft_p50_ms": _round(quantile_ms(ttft, 0.5)),
                "ttft_p99_ms": _round(quantile_ms(ttft, 0.99)),
                "tpot_p50_ms": _round(quantile_ms(tpot, 0.5)),
                "tpot_p99_ms": _round(quantile_ms(tpot, 0.99)),
                "ttft_count": histogram_count(ttft),
                "reasons": _reasons(reasons, requests) if deployments is None else None,
            },
        }
    )


def _reasons(reasons: Mapping[str, int], requests: int) -> list[dict[str, Any]]:
    total = sum(reasons.values()) or 1
    rows = []
    for key, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        route, _, code = key.partition(":")
        rows.append(
            {"route": route, "reason": code, "count": count, "percent": round(100 * count / total)}
        )
    return rows


# -- reads and charts ---------------------------------------------------------------------------


def samples_since(start: datetime) -> list[tuple[datetime, dict[str, Any]]]:
    return list(
        RouterStatsSample.objects.filter(received_at__gte=start)
        .order_by()
        .values_list("received_at", "serving")
    )


def _line(points: list[dict[str, Any]], field: str) -> list[tuple[float, float | None]]:
    return [(p["x"], p[field]) for p in points]


# Each chart's title, shown above it (the SVG's own title names the scope and window too).
CHART_TITLES = {
    "tokens": "Generated tokens/s",
    "ttft": "Time to first token (ms)",
    "tpot": "Time per output token (ms)",
    "kv": "KV-cache use (%) per engine",
    "running": "Running sequences per engine",
    "waiting": "Waiting requests per engine",
    "pd": "Requests served PD (% of requests)",
}


def panel_charts(data: Mapping[str, Any], scope: str) -> dict[str, str]:
    """The panel's SVG charts, each titled with its scope, window and unit."""
    span = float(data["seconds"])
    points = data["points"]
    label = f"{scope}, last {data['window_label']}"
    engines = data["engines"]

    def engine_name(e: Mapping[str, Any]) -> str:
        return f"{e['deployment']} {e['role'].upper()}"

    def per_engine(field: str) -> dict[str, list[tuple[float, float | None]]]:
        return {engine_name(e): _line(e["points"], field) for e in engines}

    drawn = {
        "tokens": charts.time_chart(
            {"tokens/s": _line(points, "tokens_per_second")},
            title=f"{CHART_TITLES['tokens']}, {label}",
            y_label="tokens/s",
            span=span,
        ),
        "ttft": charts.time_chart(
            {"p50": _line(points, "ttft_p50_ms"), "p99": _line(points, "ttft_p99_ms")},
            title=f"{CHART_TITLES['ttft']}, {label}",
            y_label="ms",
            span=span,
        ),
        "tpot": charts.time_chart(
            {"p50": _line(points, "tpot_p50_ms"), "p99": _line(points, "tpot_p99_ms")},
            title=f"{CHART_TITLES['tpot']}, {label}",
            y_label="ms",
            span=span,
        ),
        "kv": charts.time_chart(
            per_engine("kv_usage_perc"),
            title=f"{CHART_TITLES['kv']}, {label}",
            y_label="%",
            span=span,
        ),
        "running": charts.time_chart(
            per_engine("running"),
            title=f"{CHART_TITLES['running']}, {label}",
            y_label="sequences",
            span=span,
        ),
        "waiting": charts.time_chart(
            per_engine("waiting"),
            title=f"{CHART_TITLES['waiting']}, {label}",
            y_label="requests",
            span=span,
        ),
        "pd": charts.time_chart(
            {"PD share": _line(points, "pd_share_percent")},
            title=f"{CHART_TITLES['pd']}, {label}",
            y_label="%",
            span=span,
        ),
    }
    return {key: str(svg) for key, svg in drawn.items()}


def serving_panel(
    window_key: str | None,
    *,
    deployments: Collection[int] | None = None,
    scope: str = "fleet",
    now: datetime | None = None,
) -> dict[str, Any]:
    """Everything the panel shows: the aggregated figures and their charts."""
    window = window_of(window_key)
    now = now or timezone.now()
    samples = samples_since(now - timedelta(seconds=window.seconds))
    data = aggregate(samples, now=now, window=window, deployments=deployments)
    data["scope"] = scope
    data["charts"] = panel_charts(data, scope)
    data["figures"] = [(key, CHART_TITLES[key], svg) for key, svg in data["charts"].items() if svg]
    data["has_data"] = any(data["charts"].values()) or bool(data["summary"]["requests"])
    return data
