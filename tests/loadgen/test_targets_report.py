"""Mode-to-target planning and the MISSION-shaped table."""

from __future__ import annotations

import pytest

from loadgen.records import RequestRecord
from loadgen.report import Row, format_errors, format_ratios, format_table, ratio_rows
from loadgen.stats import summarize
from loadgen.targets import FORCED_MODE_HEADER, TargetError, plan_targets

NONE = {"cpu": None, "gpu": None, "hetero": None}


def test_router_target_forces_each_mode_by_header() -> None:
    targets = plan_targets("all", "http://router:7010", NONE)
    assert [t.mode for t in targets] == ["cpu", "gpu", "hetero"]
    assert [t.headers[FORCED_MODE_HEADER] for t in targets] == ["cpu-only", "gpu-only", "auto"]
    assert {t.url for t in targets} == {"http://router:7010"}


def test_per_mode_targets_are_unforced_and_win_over_the_router() -> None:
    targets = plan_targets("all", "http://router", {**NONE, "gpu": "http://gpu"})
    by_mode = {t.mode: t for t in targets}
    assert by_mode["gpu"].url == "http://gpu" and by_mode["gpu"].forced is None
    assert by_mode["cpu"].url == "http://router" and by_mode["cpu"].forced == "cpu-only"


def test_default_modes_are_the_ones_given_targets() -> None:
    targets = plan_targets(None, None, {**NONE, "gpu": "http://g", "cpu": "http://c"})
    assert [t.mode for t in targets] == ["cpu", "gpu"]
    plain = plan_targets(None, "http://engine", NONE)
    assert [(t.mode, t.forced) for t in plain] == [("target", None)]


def test_missing_targets_are_named() -> None:
    with pytest.raises(TargetError, match="--target-hetero"):
        plan_targets("all", None, {**NONE, "gpu": "http://g", "cpu": "http://c"})
    with pytest.raises(TargetError):
        plan_targets(None, None, NONE)


def _row(mode: str, level: int, tokens_per_s: float, ttft: float) -> Row:
    # One request of 11 tokens over 1 s of wall time gives tokens_per_s via duration.
    chunks = [ttft + i * 0.01 for i in range(11)]
    record = RequestRecord(0, 8, 11, chunk_times=chunks, ok=True)
    failed = RequestRecord(1, 8, 11, ok=False, error="HTTP 503: busy")
    summary = summarize([record, failed], 11 / tokens_per_s)
    return Row(mode, level, "http://x", "m", summary, [record, failed])


def test_table_and_ratios() -> None:
    rows = [_row("cpu", 1, 10.0, 0.9), _row("gpu", 1, 50.0, 0.15), _row("hetero", 1, 100.0, 0.3)]
    table = format_table(rows)
    assert table.count("\n") == 4
    assert "| hetero | 1 | 1 / 1 | 100.0 | 300.0 | 10.0 |" in table
    ratios = {r["metric"]: r for r in ratio_rows(rows)}
    assert ratios["throughput (tok/s)"]["hetero_over_cpu"] == pytest.approx(10.0)
    assert ratios["throughput (tok/s)"]["hetero_over_gpu"] == pytest.approx(2.0)
    assert ratios["TTFT mean (ms)"]["hetero_over_gpu"] == pytest.approx(2.0)
    assert "| 1 | throughput (tok/s) | 10.00x | 2.00x |" in format_ratios(rows)
    assert format_errors(rows).count("1 x HTTP 503: busy") == 3


def test_no_ratios_without_hetero() -> None:
    assert format_ratios([_row("gpu", 1, 50.0, 0.1)]) == ""
