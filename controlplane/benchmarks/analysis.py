"""Pure calculations over stored benchmark summaries: headline figures, regressions against a
baseline, and the mode advisor. No I/O; a summary is the JSON the load generator writes
(``{"config": ..., "rows": [{"mode", "concurrency", "summary": {...}}], "ratios": [...]}``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# (name, how to read it from a row's summary, higher is better)
FIGURES: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("throughput_tok_s", ("output_throughput",), True),
    ("ttft_mean_ms", ("ttft", "mean"), False),
    ("tpot_mean_ms", ("tpot", "mean"), False),
    ("e2e_p99_ms", ("e2e", "p99"), False),
)

MODES = ("gpu", "hetero", "cpu")


def _dig(data: Mapping[str, Any], path: Sequence[str]) -> float | None:
    value: Any = data
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def row_figures(row: Mapping[str, Any]) -> dict[str, float | None]:
    summary = row.get("summary") or {}
    figures = {name: _dig(summary, path) for name, path, _ in FIGURES}
    figures["ttft_p99_ms"] = _dig(summary, ("ttft", "p99"))
    figures["tpot_p99_ms"] = _dig(summary, ("tpot", "p99"))
    figures["failed"] = _dig(summary, ("failed",))
    return figures


def rows_by_key(summary: Mapping[str, Any]) -> dict[tuple[str, int], dict[str, float | None]]:
    """(mode, concurrency) -> figures, for every row of a stored summary."""
    rows: dict[tuple[str, int], dict[str, float | None]] = {}
    for row in summary.get("rows", []) or []:
        try:
            key = (str(row["mode"]), int(row["concurrency"]))
        except (KeyError, TypeError, ValueError):
            continue
        rows[key] = row_figures(row)
    return rows


@dataclass(frozen=True)
class Change:
    figure: str
    mode: str
    concurrency: int
    baseline: float
    current: float
    change_percent: float  # positive = worse


def compare_to_baseline(
    current: Mapping[str, Any], baseline: Mapping[str, Any], threshold_percent: float
) -> list[Change]:
    """Every figure of every shared (mode, concurrency) row that is worse by more than the
    threshold. Throughput is worse when it drops; latencies are worse when they grow."""
    if threshold_percent < 0:
        raise ValueError(f"threshold_percent must be non-negative, got {threshold_percent}")
    now, then = rows_by_key(current), rows_by_key(baseline)
    worse: list[Change] = []
    for key in sorted(set(now) & set(then)):
        for name, _, higher_is_better in FIGURES:
            a, b = then[key].get(name), now[key].get(name)
            if a is None or b is None or a == 0:
                continue
            change = (a - b) / a * 100 if higher_is_better else (b - a) / a * 100
            if change > threshold_percent:
                worse.append(Change(name, key[0], key[1], a, b, round(change, 2)))
    return worse


@dataclass(frozen=True)
class Recommendation:
    mode: str | None
    goal: str
    reason: str
    policy: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, dict[str, float | None]] = field(default_factory=dict)
    considered: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


POLICY_FOR_MODE: dict[str, dict[str, Any]] = {
    "gpu": {"mode": "gpu-only", "enable_auto_pd_offload": False},
    "hetero": {"mode": "auto", "enable_auto_pd_offload": True},
    "cpu": {"mode": "cpu-only", "enable_auto_pd_offload": False},
}
GOALS = ("latency", "throughput", "slo")


def best_rows(summaries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """For each mode, the figures at its highest measured concurrency (the most recent
    summary wins), which is where throughput differences between modes show."""
    best: dict[str, tuple[int, dict[str, float | None]]] = {}
    for summary in summaries:
        for (mode, concurrency), figures in rows_by_key(summary).items():
            if figures.get("throughput_tok_s") is None:
                continue
            if mode not in best or concurrency > best[mode][0]:
                best[mode] = (concurrency, {**figures, "concurrency": float(concurrency)})
    return {mode: figures for mode, (_, figures) in best.items()}


def advise(
    summaries: Iterable[Mapping[str, Any]],
    goal: str,
    *,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    cpu_max_batch_size: int | None = None,
) -> Recommendation:
    """MISSION.md's guidance, decided from measured runs instead of a fixed table:
    lowest latency -> the mode with the lowest TTFT (then TPOT); highest throughput -> the mode
    with the highest output throughput; an SLO -> the highest throughput among modes whose
    p99 TTFT and TPOT meet it. No GPU measured -> CPU mode."""
    if goal not in GOALS:
        raise ValueError(f"goal must be one of {', '.join(GOALS)}; got {goal!r}")
    figures = best_rows(summaries)
    considered = sorted(figures, key=MODES.index) if figures else []
    if not figures:
        return Recommendation(None, goal, "no measured runs yet: run a benchmark in each mode")
    if set(figures) == {"cpu"}:
        return _recommend(
            "cpu",
            goal,
            "only CPU mode was measured (no GPU/NPU)",
            figures,
            considered,
            cpu_max_batch_size,
        )

    def value(mode: str, name: str, missing: float) -> float:
        found = figures[mode].get(name)
        return missing if found is None else found

    if goal == "latency":
        mode = min(
            considered,
            key=lambda m: (
                value(m, "ttft_mean_ms", float("inf")),
                value(m, "tpot_mean_ms", float("inf")),
            ),
        )
        reason = (
            f"lowest mean time to first token: {value(mode, 'ttft_mean_ms', 0):.1f} ms "
            f"at concurrency {int(value(mode, 'concurrency', 0))}"
        )
    elif goal == "throughput":
        mode = max(considered, key=lambda m: value(m, "throughput_tok_s", 0.0))
        reason = (
            f"highest output throughput: {value(mode, 'throughput_tok_s', 0):.1f} tok/s "
            f"at concurrency {int(value(mode, 'concurrency', 0))}"
        )
    else:
        if ttft_slo_ms is None and tpot_slo_ms is None:
            raise ValueError("the slo goal needs ttft_slo_ms or tpot_slo_ms")
        meeting = [
            m
            for m in considered
            if (ttft_slo_ms is None or value(m, "ttft_p99_ms", float("inf")) <= ttft_slo_ms)
            and (tpot_slo_ms is None or value(m, "tpot_p99_ms", float("inf")) <= tpot_slo_ms)
        ]
        if not meeting:
            return Recommendation(
                None,
                goal,
                "no measured mode meets the SLO at p99; relax it or add capacity",
                figures=figures,
                considered=considered,
            )
        mode = max(meeting, key=lambda m: value(m, "throughput_tok_s", 0.0))
        reason = (
            f"meets the SLO at p99 ({', '.join(meeting)} do) with the highest throughput: "
            f"{value(mode, 'throughput_tok_s', 0):.1f} tok/s"
        )
    return _recommend(mode, goal, reason, figures, considered, cpu_max_batch_size)


def _recommend(
    mode: str,
    goal: str,
    reason: str,
    figures: dict[str, dict[str, float | None]],
    considered: list[str],
    cpu_max_batch_size: int | None,
) -> Recommendation:
    policy = dict(POLICY_FOR_MODE.get(mode, {}))
    if mode == "hetero" and cpu_max_batch_size:
        policy["cpu_max_batch_size"] = cpu_max_batch_size
    return Recommendation(mode, goal, reason, policy, figures, considered)
