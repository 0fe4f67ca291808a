"""A benchmark run's figures, shaped for the charts. Pure functions over plain values.

A run's ``summary`` holds the load generator's JSON (``loadgen.report.to_json``: a
``rows`` list with one ``summary`` per mode and concurrency). Runs stored without it — older
runs, runs that failed midway — fall back to figures computed from their per-request samples,
and runs with neither show "no data" rather than an empty chart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.stats import percentile

PERCENTILES = ("median", "p90", "p99")
MODE_ORDER = {"cpu": 0, "gpu": 1, "hetero": 2}


@dataclass(frozen=True)
class SampleRow:
    """One measured request (a BenchmarkSample's chart-relevant fields)."""

    mode: str
    concurrency: int
    ok: bool
    output_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    started_at: float


@dataclass
class Figures:
    """One mode at one concurrency level."""

    mode: str
    concurrency: int
    completed: int
    failed: int
    throughput: float | None  # output tokens/s
    ttft: dict[str, float | None] = field(default_factory=dict)
    tpot: dict[str, float | None] = field(default_factory=dict)
    e2e: dict[str, float | None] = field(default_factory=dict)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _dist(raw: Any) -> dict[str, float | None]:
    raw = raw if isinstance(raw, Mapping) else {}
    return {key: _number(raw.get(key)) for key in ("mean", *PERCENTILES)}


def figures_from_summary(summary: Mapping[str, Any]) -> list[Figures]:
    """Read the load generator's rows; anything malformed is skipped, never fatal."""
    out: list[Figures] = []
    rows = summary.get("rows") if isinstance(summary, Mapping) else None
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, Mapping) or not isinstance(row.get("summary"), Mapping):
            continue
        s = row["summary"]
        try:
            concurrency = int(row.get("concurrency", 0))
        except (TypeError, ValueError):
            continue
        completed = int(_number(s.get("completed")) or 0)
        out.append(
            Figures(
                mode=str(row.get("mode", "?")),
                concurrency=concurrency,
                completed=completed,
                failed=int(_number(s.get("failed")) or 0),
                throughput=_number(s.get("output_throughput")) if completed else None,
                ttft=_dist(s.get("ttft")),
                tpot=_dist(s.get("tpot")),
                e2e=_dist(s.get("e2e")),
            )
        )
    return sort_figures(out)


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {key: None for key in ("mean", *PERCENTILES)}
    return {
        "mean": sum(values) / len(values),
        "median": percentile(values, 50.0),
        "p90": percentile(values, 90.0),
        "p99": percentile(values, 99.0),
    }


def figures_from_samples(samples: Iterable[SampleRow]) -> list[Figures]:
    """Figures from per-request rows: throughput is output tokens over the group's wall span."""
    groups: dict[tuple[str, int], list[SampleRow]] = defaultdict(list)
    for sample in samples:
        groups[(sample.mode, sample.concurrency)].append(sample)
    out: list[Figures] = []
    for (mode, concurrency), rows in groups.items():
        done = [r for r in rows if r.ok]
        ends = [r.started_at + r.e2e_ms / 1000.0 for r in done if r.e2e_ms is not None]
        span = (max(ends) - min(r.started_at for r in done)) if ends else 0.0
        tokens = sum(r.output_tokens for r in done)
        out.append(
            Figures(
                mode=mode,
                concurrency=concurrency,
                completed=len(done),
                failed=len(rows) - len(done),
                throughput=tokens / span if span > 0 else None,
                ttft=_percentiles([r.ttft_ms for r in done if r.ttft_ms is not None]),
                tpot=_percentiles([r.tpot_ms for r in done if r.tpot_ms is not None]),
                e2e=_percentiles([r.e2e_ms for r in done if r.e2e_ms is not None]),
            )
        )
    return sort_figures(out)


def sort_figures(figures: list[Figures]) -> list[Figures]:
    return sorted(figures, key=lambda f: (MODE_ORDER.get(f.mode, 9), f.mode, f.concurrency))


def throughput_series(figures: Sequence[Figures]) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for f in figures:
        if f.throughput is not None:
            series[f.mode].append((float(f.concurrency), f.throughput))
    return dict(series)


def percentile_series(
    figures: Sequence[Figures], metric: str, concurrency: int | None = None
) -> dict[str, list[float | None]]:
    """Per mode, the metric's median/p90/p99 at one concurrency level (the highest by default)."""
    if not figures:
        return {}
    level = concurrency if concurrency is not None else max(f.concurrency for f in figures)
    series: dict[str, list[float | None]] = {}
    for f in figures:
        if f.concurrency == level:
            dist = getattr(f, metric)
            if any(dist.get(p) is not None for p in PERCENTILES):
                series[f.mode] = [dist.get(p) for p in PERCENTILES]
    return series


def eta_text(seconds: float | None) -> str:
    """An ETA as people say it: "about 40 s", "about 3 min"; "" when unknown."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"about {max(round(seconds), 1)} s"
    return f"about {round(seconds / 60)} min"


def run_banner(
    pk: int,
    state: str,
    phase: str,
    points_done: int,
    points_total: int,
    eta_seconds: float | None,
) -> str:
    """The one sentence a run's page says about where the run is, from its one state (the
    badge and the Cancel button derive from the same state)."""
    if state == "queued":
        return f"Run {pk} is queued: a worker starts it shortly."
    if state == "running":
        where = f": {phase}" if phase else ""
        if eta_seconds is not None:
            return f"Run {pk} is running{where}; {eta_text(eta_seconds)} left."
        return f"Run {pk} is running{where}; the ETA follows the first finished point."
    if state == "cancelling":
        kept = f" ({points_done} of {points_total} points finished)" if points_total else ""
        return (
            f"Run {pk} is cancelling: it stops within a second and keeps the points it "
            f"finished{kept}."
        )
    if state == "cancelled":
        if points_done:
            return f"Run {pk} was cancelled after {points_done} of {points_total} points."
        return f"Run {pk} was cancelled before it measured a point."
    if state == "failed":
        if points_done:
            return f"Run {pk} failed after {points_done} of {points_total} points."
        return f"Run {pk} failed."
    return f"Run {pk} finished: {points_done} point{'s' if points_done != 1 else ''} measured."


def recorded_facts(recorded: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """(label, text) of what a run ran under: its policy revision (and every revision seen
    while it ran), its profile and fingerprint, its engines. Empty for a run that recorded
    nothing (runs from before it was recorded)."""
    recorded = recorded if isinstance(recorded, Mapping) else {}
    out: list[tuple[str, str]] = []
    policy = recorded.get("policy")
    if isinstance(policy, Mapping):
        text = f"{policy.get('name')} v{policy.get('version')}"
        seen = [v for v in policy.get("versions_seen") or [] if v != policy.get("version")]
        if seen:
            versions = ", ".join(f"v{v}" for v in policy.get("versions_seen") or [])
            text += f" (changed while it ran: {versions})"
        out.append(("Policy", text))
    profile = recorded.get("profile")
    if isinstance(profile, Mapping):
        text = f"{profile.get('name')} · fingerprint {profile.get('fingerprint')}"
        if profile.get("updated_at"):
            text += f" · updated {str(profile['updated_at'])[:19].replace('T', ' ')}"
        out.append(("Profile", text))
    engines = recorded.get("engines")
    if isinstance(engines, Mapping):
        parts = []
        if engines.get("kind"):
            parts.append(str(engines["kind"]))
        if engines.get("sim_devices"):
            parts.append(" + ".join(str(d) for d in engines["sim_devices"]))
        for key, label in (("gpu_image", "GPU image"), ("cpu_image", "CPU image")):
            if engines.get(key) and engines.get("kind") != "simulator":
                parts.append(f"{label} {engines[key]}")
        if engines.get("agent_version"):
            parts.append(f"agent {engines['agent_version']}")
        if engines.get("generation") is not None:
            parts.append(f"generation {engines['generation']}")
        if engines.get("target"):
            parts.append(f"target {engines['target']}")
        if parts:
            out.append(("Engines", " · ".join(parts)))
    return out


def policy_label(recorded: Mapping[str, Any] | None) -> str:
    """ "default v3", or "" when the run recorded no policy."""
    policy = recorded.get("policy") if isinstance(recorded, Mapping) else None
    if not isinstance(policy, Mapping):
        return ""
    return f"{policy.get('name')} v{policy.get('version')}"
