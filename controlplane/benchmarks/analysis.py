"""Pure calculations over stored benchmark summaries: headline figures, regressions against a
baseline, and the mode advisor. No I/O; a summary is the JSON the load generator writes
(``{"config": ..., "rows": [{"mode", "concurrency", "summary": {...}}], "ratios": [...]}``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loadgen.goodput import GoodputSearch

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
    # What the operator must know before acting on it: partial runs among the figures,
    # figures measured under different policy revisions, modes compared at different levels.
    caveats: list[str] = field(default_factory=list)
    # Per mode, the run its figures come from: {"run", "policy", "partial"}.
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    # sysHAX's guidance for the goal and whether these measurements agree with it.
    guidance: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


POLICY_FOR_MODE: dict[str, dict[str, Any]] = {
    "gpu": {"mode": "gpu-only", "enable_auto_pd_offload": False},
    "hetero": {"mode": "auto", "enable_auto_pd_offload": True},
    "cpu": {"mode": "cpu-only", "enable_auto_pd_offload": False},
}
GOALS = ("latency", "throughput", "slo")
# Hetero must sustain this much more than GPU-only at the SLO before it is recommended: below
# it the gain is within what repeated sweeps of one mode differ by.
GOODPUT_GAIN = 1.02


def _same_slo(config: Mapping[str, Any], ttft_ms: float | None, tpot_ms: float | None) -> bool:
    slo = config.get("slo_ms") or {}
    return slo.get("ttft") == ttft_ms and slo.get("tpot") == tpot_ms


def sweeps_at_slo(
    summaries: Iterable[Mapping[str, Any]], ttft_slo_ms: float | None, tpot_slo_ms: float | None
) -> dict[str, GoodputSearch] | None:
    """The newest stored goodput sweep with GPU and hetero rows, measured at exactly this SLO.

    ``summaries`` come oldest first, as ``services.advisor_summaries`` returns them."""
    for summary in reversed(list(summaries)):
        sweeps = summary.get("sweeps")
        if not isinstance(sweeps, Mapping) or not _same_slo(
            summary.get("config") or {}, ttft_slo_ms, tpot_slo_ms
        ):
            continue
        try:
            found = {mode: GoodputSearch.from_dict(dict(data)) for mode, data in sweeps.items()}
        except (KeyError, TypeError, ValueError):
            continue
        if "gpu" in found and "hetero" in found:
            return found
    return None


def crossover_rate(gpu: GoodputSearch, hetero: GoodputSearch) -> float | None:
    """The lowest rate both measured above which hetero's goodput stays above GPU-only's by
    ``GOODPUT_GAIN`` up to hetero's max goodput: where hetero starts to pay."""
    top = hetero.max_goodput_rate
    shared = sorted({p.rate for p in gpu.points} & {p.rate for p in hetero.points})
    crossing = None
    for rate in shared:
        if top is not None and rate > top:
            break
        h, g = hetero.goodput_at(rate), gpu.goodput_at(rate)
        if h is None or g is None:
            continue
        crossing = (rate if crossing is None else crossing) if h > g * GOODPUT_GAIN else None
    return crossing


def _goodput_advice(
    sweeps: dict[str, GoodputSearch], goal: str, cpu_max_batch_size: int | None
) -> Recommendation:
    gpu, hetero = sweeps["gpu"], sweeps["hetero"]
    best = {mode: s.max_goodput_rate for mode, s in sweeps.items()}
    figures = {
        mode: {
            "max_goodput_rps": best[mode],
            "best_attainment_percent": s.best_attainment,
            "crossover_rps": crossover_rate(gpu, hetero) if mode == "hetero" else None,
        }
        for mode, s in sweeps.items()
    }
    considered = [m for m in MODES if m in sweeps]
    g, h = best["gpu"], best["hetero"]
    if h is not None and (g is None or h > g * GOODPUT_GAIN):
        crossing = crossover_rate(gpu, hetero)
        gain = f"+{(h / g - 1) * 100:.0f} %" if g else "GPU-only meets it at no rate"
        where = f"; hetero pays above {crossing:g} req/s" if crossing is not None else ""
        return _recommend(
            "hetero",
            goal,
            f"goodput at the SLO: hetero sustains {h:g} req/s, GPU-only {g or 0:g} ({gain}){where}",
            figures,
            considered,
            cpu_max_batch_size,
        )
    if g is None:
        return Recommendation(
            None,
            goal,
            "no measured rate meets the SLO in GPU or hetero mode; relax it or add capacity",
            figures=figures,
            considered=considered,
        )
    return _recommend(
        "gpu",
        goal,
        f"goodput at the SLO: GPU-only sustains {g:g} req/s and hetero "
        f"{h if h is not None else 0:g}: the CPU adds no goodput here",
        figures,
        considered,
        cpu_max_batch_size,
    )


# sysHAX's guidance table (MISSION.md), which the advisor checks against measurements.
GUIDANCE = {"latency": "gpu", "throughput": "hetero"}
GOAL_WORDS = {"latency": "the lowest latency", "throughput": "the highest throughput"}


def run_meta(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Who measured a summary's rows: ``{"id", "partial", "label", "policy", "versions"}``
    from the ``run`` entry ``services.advisor_summaries`` adds and the policy the runner
    records in its config (``recorded_under``); empty values where unknown."""
    meta = summary.get("run")
    meta = dict(meta) if isinstance(meta, Mapping) else {}
    config = summary.get("config")
    under = meta.get("recorded_under")
    if not isinstance(under, Mapping) and isinstance(config, Mapping):
        under = config.get("recorded_under")
    policy = under.get("policy") if isinstance(under, Mapping) else None
    if isinstance(policy, Mapping) and policy.get("name"):
        seen = [v for v in policy.get("versions_seen") or [] if isinstance(v, int)]
        meta["policy"] = f"{policy['name']} v{policy.get('version')}"
        meta["versions"] = seen or [policy.get("version")]
    else:
        meta.setdefault("policy", "")
        meta.setdefault("versions", [])
    meta["partial"] = bool(meta.get("partial") or summary.get("partial"))
    return meta


def _best(
    summaries: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, dict[str, float | None]], dict[str, dict[str, Any]], bool]:
    """For each mode, the figures at the highest concurrency every mode measured (the
    most recent summary wins), which is where throughput differences between modes show
    and where they compare like for like; without a level all modes share, each mode's
    highest. Also each mode's source run and whether the levels were shared."""
    found: dict[str, dict[int, tuple[dict[str, float | None], dict[str, Any]]]] = {}
    for summary in summaries:
        meta = run_meta(summary)
        for (mode, concurrency), figures in rows_by_key(summary).items():
            if figures.get("throughput_tok_s") is None:
                continue
            found.setdefault(mode, {})[concurrency] = (figures, meta)
    if not found:
        return {}, {}, True
    shared = set.intersection(*(set(levels) for levels in found.values()))
    best: dict[str, dict[str, float | None]] = {}
    sources: dict[str, dict[str, Any]] = {}
    for mode, levels in found.items():
        level = max(shared) if shared else max(levels)
        figures, meta = levels[level]
        best[mode] = {**figures, "concurrency": float(level)}
        sources[mode] = {
            "run": meta.get("id"),
            "policy": meta.get("policy", ""),
            "versions": meta.get("versions", []),
            "partial": meta.get("partial", False),
            "label": meta.get("label", ""),
        }
    return best, sources, bool(shared)


def best_rows(summaries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """For each mode, the figures the advisor compares (see ``_best``)."""
    return _best(list(summaries))[0]


def caveats_for(sources: Mapping[str, Mapping[str, Any]], shared_level: bool) -> list[str]:
    """What the figures of ``sources`` (per mode, the run they come from) must be read with."""
    out: list[str] = []
    policies = {src.get("policy") or "unrecorded" for src in sources.values()}
    if len(policies) > 1:
        by_mode = ", ".join(
            f"{mode} under {src.get('policy') or 'an unrecorded policy'}"
            + (f" (run #{src['run']})" if src.get("run") else "")
            for mode, src in sorted(sources.items(), key=lambda item: _mode_order(item[0]))
        )
        out.append(
            f"the modes were measured under different policy revisions ({by_mode}); "
            "rerun them under one revision before acting on this"
        )
    for mode, src in sorted(sources.items(), key=lambda item: _mode_order(item[0])):
        versions = [v for v in src.get("versions") or [] if v is not None]
        if len(versions) > 1:
            out.append(
                f"the policy changed while {mode} was measured (run #{src.get('run')}: "
                f"versions {', '.join(f'v{v}' for v in versions)})"
            )
    partial = sorted(
        {(src.get("run"), src.get("label") or "partial") for src in sources.values()
         if src.get("partial")},
        key=lambda item: item[0] or 0,
    )  # fmt: skip
    for run, label in partial:
        out.append(f"run #{run} is partial ({label}): only its finished points count")
    if not shared_level and len(sources) > 1:
        out.append("the modes share no measured concurrency level: each is at its highest")
    return out


def _mode_order(mode: str) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


def guidance_note(goal: str, mode: str | None) -> str:
    """sysHAX's guidance for the goal beside what the measurements recommend, so the page
    never states the table's answer as if it were the measured one."""
    expected = GUIDANCE.get(goal)
    if expected is None or mode is None:
        return ""
    words = GOAL_WORDS[goal]
    if mode == expected:
        return f"This agrees with sysHAX's guidance: {expected} mode for {words}."
    return (
        f"sysHAX's guidance says {expected} mode for {words}; these measurements say "
        f"{mode} mode, and the advice follows the measurements."
    )


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
    with the highest output throughput; an SLO -> from a goodput sweep at exactly that SLO,
    hetero when it sustains more than GPU-only (naming the crossover rate), else GPU; without
    one, the highest throughput among the non-hetero modes whose p99 TTFT and TPOT meet it.
    No GPU measured -> CPU mode."""
    if goal not in GOALS:
        raise ValueError(f"goal must be one of {', '.join(GOALS)}; got {goal!r}")
    summaries = list(summaries)
    if goal == "slo":
        if ttft_slo_ms is None and tpot_slo_ms is None:
            raise ValueError("the slo goal needs ttft_slo_ms or tpot_slo_ms")
        sweeps = sweeps_at_slo(summaries, ttft_slo_ms, tpot_slo_ms)
        if sweeps is not None:
            return _goodput_advice(sweeps, goal, cpu_max_batch_size)
    figures, sources, shared = _best(summaries)
    considered = sorted(figures, key=MODES.index) if figures else []
    if not figures:
        return Recommendation(None, goal, "no measured runs yet: run a benchmark in each mode")
    caveats = caveats_for(sources, shared)
    if set(figures) == {"cpu"}:
        return _recommend(
            "cpu",
            goal,
            "only CPU mode was measured (no GPU/NPU)",
            figures,
            considered,
            cpu_max_batch_size,
            caveats=caveats,
            sources=sources,
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
        meeting = [
            m
            for m in considered
            if (ttft_slo_ms is None or value(m, "ttft_p99_ms", float("inf")) <= ttft_slo_ms)
            and (tpot_slo_ms is None or value(m, "tpot_p99_ms", float("inf")) <= tpot_slo_ms)
        ]
        # Hetero is recommended for an SLO only from a goodput sweep at that SLO (above).
        unswept = " (hetero is recommended for an SLO only from a goodput sweep at it)"
        offered = [m for m in meeting if m != "hetero"]
        if not offered:
            why = "no measured mode meets the SLO at p99; relax it or add capacity"
            if meeting:
                why = "only hetero meets the SLO at p99 in these runs" + unswept
            return Recommendation(
                None,
                goal,
                why,
                figures=figures,
                considered=considered,
                caveats=caveats,
                sources=sources,
            )
        mode = max(offered, key=lambda m: value(m, "throughput_tok_s", 0.0))
        reason = (
            f"meets the SLO at p99 ({', '.join(meeting)} do) with the highest throughput: "
            f"{value(mode, 'throughput_tok_s', 0):.1f} tok/s"
            + (unswept if "hetero" in meeting else "")
        )
    return _recommend(
        mode,
        goal,
        reason,
        figures,
        considered,
        cpu_max_batch_size,
        caveats=caveats,
        sources=sources,
    )


def _recommend(
    mode: str,
    goal: str,
    reason: str,
    figures: dict[str, dict[str, float | None]],
    considered: list[str],
    cpu_max_batch_size: int | None,
    *,
    caveats: list[str] | None = None,
    sources: dict[str, dict[str, Any]] | None = None,
) -> Recommendation:
    policy = dict(POLICY_FOR_MODE.get(mode, {}))
    if mode == "hetero" and cpu_max_batch_size:
        policy["cpu_max_batch_size"] = cpu_max_batch_size
    return Recommendation(
        mode,
        goal,
        reason,
        policy,
        figures,
        considered,
        caveats=list(caveats or []),
        sources=dict(sources or {}),
        guidance=guidance_note(goal, mode),
    )
