"""Tables and JSON of a benchmark. Pure: rows in, text or dicts out.

The table follows MISSION.md's: throughput (output tokens/s), time to first token, mean token
latency (mean TPOT) and p99 latency (p99 end-to-end), per mode and concurrency, then the
hetero/CPU and hetero/GPU ratios wherever those rows exist.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadgen.records import RequestRecord
from loadgen.stats import ClassSummary, Summary, ratio


@dataclass
class Row:
    """One mode at one concurrency level."""

    mode: str
    concurrency: int
    url: str
    model: str
    summary: Summary
    records: list[RequestRecord]
    # Epoch seconds the measured phase began and ended; resource use of the node, if known.
    window: tuple[float, float] | None = None
    resources: dict[str, float | None] | None = None
    # The offered request rate of a goodput sweep's row (None: the run's one --request-rate).
    rate: float | None = None
    # A mixed scenario's row: each SLO class's figures against its own SLO, and the class of
    # every request by its index (None: a run of one shape).
    classes: dict[str, ClassSummary] | None = None
    request_classes: dict[int, str] | None = None

    def to_dict(self, *, samples: bool) -> dict[str, object]:
        row: dict[str, object] = {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "url": self.url,
            "model": self.model,
            "summary": self.summary.to_dict(),
            "window": list(self.window) if self.window else None,
            "resources": self.resources,
        }
        if self.classes is not None:
            row["classes"] = {name: c.to_dict() for name, c in self.classes.items()}
        failed = [self._sample(record) for record in self.records if not record.ok]
        row["failed_requests"] = failed
        if samples:
            row["requests"] = [self._sample(record) for record in self.records]
        return row

    def _sample(self, record: RequestRecord) -> dict[str, object]:
        sample = record.sample()
        if self.request_classes is not None:
            sample["slo_class"] = self.request_classes.get(record.index)
        return sample


# (label, figure of a summary, higher is better)
_METRICS: tuple[tuple[str, Callable[[Summary], float | None], bool], ...] = (
    ("throughput (tok/s)", lambda s: s.output_throughput if s.completed else None, True),
    ("TTFT mean (ms)", lambda s: s.ttft.mean, False),
    ("mean token latency (ms)", lambda s: s.tpot.mean, False),
    ("p99 latency (ms)", lambda s: s.e2e.p99, False),
)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table with one line per (mode, concurrency)."""
    rated = any(row.rate is not None for row in rows)
    header = ["mode", "rate (req/s)" if rated else "concurrency", "ok / failed"]
    header += [label for label, _, _ in _METRICS]
    header += ["TTFT p99 (ms)", "goodput (req/s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        s = row.summary
        level = f"{row.rate:g}" if rated and row.rate is not None else str(row.concurrency)
        cells = [row.mode, level, f"{s.completed} / {s.failed}"]
        cells += [_fmt(figure(s)) for _, figure, _ in _METRICS]
        cells += [_fmt(s.ttft.p99), _fmt(s.goodput, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_rows(rows: Sequence[Row]) -> list[dict[str, object]]:
    """hetero/CPU and hetero/GPU of every metric, per concurrency level that has hetero.

    A goodput sweep's rows (``rate`` set) compare through their sweeps instead."""
    rows = [row for row in rows if row.rate is None]
    by_key = {(row.mode, row.concurrency): row.summary for row in rows}
    levels = sorted({row.concurrency for row in rows if row.mode == "hetero"})
    out: list[dict[str, object]] = []
    for level in levels:
        hetero = by_key[("hetero", level)]
        cpu = by_key.get(("cpu", level))
        gpu = by_key.get(("gpu", level))
        for label, figure, higher_is_better in _METRICS:
            out.append(
                {
                    "concurrency": level,
                    "metric": label,
                    "higher_is_better": higher_is_better,
                    "hetero_over_cpu": ratio(figure(hetero), figure(cpu)) if cpu else None,
                    "hetero_over_gpu": ratio(figure(hetero), figure(gpu)) if gpu else None,
                }
            )
    return out


def format_ratios(rows: Sequence[Row]) -> str:
    """The ratio table, or an empty string when no hetero row has a CPU or GPU row beside it."""
    ratios = [r for r in ratio_rows(rows) if r["hetero_over_cpu"] or r["hetero_over_gpu"]]
    if not ratios:
        return ""
    lines = [
        "| concurrency | metric | hetero/CPU | hetero/GPU |",
        "|---|---|---|---|",
    ]
    for r in ratios:
        cpu_ratio, gpu_ratio = r["hetero_over_cpu"], r["hetero_over_gpu"]
        assert cpu_ratio is None or isinstance(cpu_ratio, float)
        assert gpu_ratio is None or isinstance(gpu_ratio, float)
        lines.append(
            f"| {r['concurrency']} | {r['metric']} | {_times(cpu_ratio)} | {_times(gpu_ratio)} |"
        )
    return "\n".join(lines)


def format_classes(rows: Sequence[Row]) -> str:
    """A mixed scenario's rows class by class, each against its own SLO: requests, TTFT and
    TPOT p50 / p99, SLO attainment and goodput; empty when no row is a mixed one."""
    mixed = [row for row in rows if row.classes]
    if not mixed:
        return ""
    rated = any(row.rate is not None for row in mixed)
    header = [
        "mode",
        "rate (req/s)" if rated else "concurrency",
        "class",
        "service_tier",
        "ok / failed",
        "throughput (tok/s)",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TPOT p50 (ms)",
        "TPOT p99 (ms)",
        "SLO attainment",
        "goodput (req/s)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in mixed:
        level = f"{row.rate:g}" if rated and row.rate is not None else str(row.concurrency)
        for name, figures in (row.classes or {}).items():
            s = figures.summary
            attainment = figures.attainment
            cells = [
                row.mode,
                level,
                name,
                figures.service_tier,
                f"{s.completed} / {s.failed}",
                _fmt(s.output_throughput if s.completed else None),
                _fmt(s.ttft.median),
                _fmt(s.ttft.p99),
                _fmt(s.tpot.median),
                _fmt(s.tpot.p99),
                "-" if attainment is None else f"{attainment:.1f}%",
                _fmt(s.goodput, 2),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_class_slos(rows: Sequence[Row]) -> str:
    """The SLO each class of a mixed run was judged against, all classes on one line."""
    seen: dict[str, ClassSummary] = {}
    for row in rows:
        for name, figures in (row.classes or {}).items():
            seen.setdefault(name, figures)
    parts = []
    for name, figures in seen.items():
        slo = figures.slo
        bounds = [
            f"{label} <= {value:g} ms"
            for label, value in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2e_ms))
            if value is not None
        ]
        parts.append(f"{name}: {', '.join(bounds) if bounds else 'no SLO'}")
    return "; ".join(parts)


def format_errors(rows: Sequence[Row]) -> str:
    """Every failed request, grouped by error, per row; empty when nothing failed."""
    lines = []
    for row in rows:
        for error, count in row.summary.errors.items():
            lines.append(f"{row.mode} c={row.concurrency}: {count} x {error}")
    return "\n".join(lines)


def to_json(config: dict[str, object], rows: Sequence[Row], *, samples: bool) -> dict[str, object]:
    """All figures plus the run's configuration, ready for ``json.dump``."""
    return {
        "config": config,
        "rows": [row.to_dict(samples=samples) for row in rows],
        "ratios": ratio_rows(rows),
    }


def format_resources(rows: Sequence[Row]) -> str:
    """Node resource use per row, from the agents' heartbeats (empty when not measured)."""
    measured = [row for row in rows if row.resources]
    if not measured:
        return ""
    header = [
        "mode",
        "concurrency",
        "CPU % mean",
        "CPU % max",
        "memory max (GB)",
        "accelerator util mean (%)",
        "accelerator memory max (GB)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in measured:
        r = row.resources or {}
        lines.append(
            "| "
            + " | ".join(
                [
                    row.mode,
                    str(row.concurrency),
                    _fmt(r.get("cpu_percent_mean")),
                    _fmt(r.get("cpu_percent_max")),
                    _fmt(r.get("memory_used_gb_max")),
                    _fmt(r.get("accelerator_util_mean")),
                    _fmt(r.get("accelerator_memory_used_gb_max")),
                ]
            )
            + " |"
        )
    return "\n".join(lines)
