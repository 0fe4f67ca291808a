"""``syshax benchmark --scenario chat-and-batch`` end to end: through a router, which reads
each request's ``service_tier`` as its SLO class, and open loop straight to an engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.simproc import running_router, running_sim

pytestmark = pytest.mark.process


def benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "syshax.cli", "benchmark", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def gpu_router() -> Iterator[str]:
    """A router in GPU-only mode over a 20x-speed engine."""
    with (
        running_sim("a100-80gb", speed=20.0) as gpu,
        running_router(gpu, gpu, mode="gpu-only") as router,
    ):
        yield router


def check_classes(document: dict[str, object], iterations: int) -> dict[str, dict[str, object]]:
    rows = document["rows"]
    assert isinstance(rows, list) and len(rows) == 1
    row = rows[0]
    assert row["summary"]["completed"] == iterations, row["failed_requests"]
    section = row["classes"]
    assert list(section) == ["interactive", "batch"]
    assert sum(c["summary"]["requests"] for c in section.values()) == iterations
    for name, tier, tokens in (("interactive", "priority", 256), ("batch", "flex", 1024)):
        figures = section[name]
        assert figures["service_tier"] == tier
        assert figures["summary"]["requests"] >= 1
        # Each class at its own shape: chat-and-batch's short and medium.
        assert figures["summary"]["total_output_tokens"] == figures["summary"]["requests"] * tokens
        assert figures["summary"]["ttft"]["median"] > 0
    classes = {sample["slo_class"] for sample in row["requests"]}
    assert classes == {"interactive", "batch"}
    return section


def test_a_mixed_scenario_through_a_router_reports_both_classes(
    gpu_router: str, tmp_path: Path
) -> None:
    out = tmp_path / "mixed.json"
    done = benchmark(
        "--scenario", "chat-and-batch", "--concurrency", "4", "--iterations", "12",
        "--warmup", "0", "--target", gpu_router, "--json", str(out), "--samples",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "1000", "--sim-speed", "20",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mixed scenario chat-and-batch" in done.stdout
    assert "| target | 4 | interactive | priority |" in done.stdout
    assert "| target | 4 | batch | flex |" in done.stdout
    document = json.loads(out.read_text())
    assert document["config"]["scenario"]["name"] == "chat-and-batch"
    assert document["config"]["class_slo_ms"]["batch"] == {
        "ttft": 60000.0,
        "tpot": 5000.0,
        "e2e": None,
    }
    section = check_classes(document, 12)
    # Generous SLOs: every request met its class's.
    for figures in section.values():
        assert figures["attainment"] == 100.0
    assert document["rows"][0]["summary"]["good_requests"] == 12
    # The router took each request's service_tier as its class: its decisions by class
    # match the classes the generator drew.
    with urllib.request.urlopen(f"{gpu_router}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    for name, figures in section.items():
        pattern = rf'^syshax_router_class_decisions_total{{class="{name}",[^}}]*}} (\S+)$'
        decided = sum(float(v) for v in re.findall(pattern, metrics, re.MULTILINE))
        assert decided == figures["summary"]["requests"], (name, metrics)


def test_a_mixed_scenario_at_a_request_rate(fast_sim: str, tmp_path: Path) -> None:
    out = tmp_path / "rate.json"
    done = benchmark(
        "--scenario", "chat-and-batch", "--concurrency", "8", "--request-rate", "40",
        "--iterations", "10", "--warmup", "0", "--target", fast_sim, "--json", str(out),
        "--samples", "--seed", "3",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out.read_text())
    assert document["config"]["request_rate"] == 40
    section = check_classes(document, 10)
    assert all(figures["attainment"] is None for figures in section.values())  # no SLO given
