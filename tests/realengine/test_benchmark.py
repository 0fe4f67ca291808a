"""`syshax benchmark` through the router on real vLLM and on the simulator: exact token counts
in every mode."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from common.supervisor import python_argv
from tests.router.router_procs import ROOT, Proc, metric

OUTPUT_TOKENS = 48


def _bench(router: Proc, out: Path, *mode: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        python_argv(
            "benchmark",
            "--target",
            router.url,
            "--scenario",
            "custom",
            "--input-tokens",
            "64",
            "--output-tokens",
            str(OUTPUT_TOKENS),
            "--concurrency",
            "2",
            "--iterations",
            "4",
            "--warmup",
            "0",
            *mode,
            "--json",
            str(out),
            "--samples",
            "--no-progress",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    for row in rows:
        summary = row["summary"]
        assert summary["failed"] == 0, row["failed_requests"]
        assert summary["completed"] == 4
        assert summary["total_output_tokens"] == 4 * OUTPUT_TOKENS
        requests = row["requests"]
        assert [r["output_tokens"] for r in requests] == [OUTPUT_TOKENS] * 4, row["mode"]
        assert all(r["prompt_tokens"] > 0 for r in requests)
    return rows


def test_benchmark_counts_tokens_exactly_in_every_mode(router: Proc, tmp_path: Path) -> None:
    rows = _bench(router, tmp_path / "modes.json", "--mode", "all")
    assert [row["mode"] for row in rows] == ["cpu", "gpu", "hetero"]
    decisions = {row["mode"]: {r["decision"] for r in row["requests"]} for row in rows}
    assert decisions["cpu"] == {"cpu-only"}
    assert decisions["gpu"] == {"gpu-only"}
    assert decisions["hetero"] <= {"gpu-only", "pd"}


def test_benchmark_through_pd_counts_tokens_exactly(router: Proc, tmp_path: Path) -> None:
    """Unforced, the router's own policy (forced-pd in this package) sends every request
    through the KV connector; the counts stay exact and every handoff is proven used."""
    hits = metric(router, "syshax_router_kv_transfers_total", outcome="hit")
    (row,) = _bench(router, tmp_path / "pd.json")
    assert {r["decision"] for r in row["requests"]} == {"pd"}
    assert metric(router, "syshax_router_kv_transfers_total", outcome="hit") == hits + 4
