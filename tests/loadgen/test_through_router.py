"""The generator through ``syshax router`` in front of a CPU and a GPU simulated engine."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from syshax.loadgen.simproc import running_router, running_sim

SYSHAX = ("--syshax-compat",)


@pytest.fixture(scope="module")
def pd_router() -> Iterator[str]:
    """A router forcing PD (GPU prefill, CPU decode) over two 20x-speed engines."""
    with (
        # The router's default PD protocol is sysHAX's: the engines' sysHAX-compatible mode.
        running_sim("kunpeng-920-7280z", speed=20.0, extra_args=SYSHAX) as cpu,
        running_sim("a100-80gb", speed=20.0, extra_args=SYSHAX) as gpu,
        running_router(gpu, cpu, mode="forced-pd") as router,
    ):
        yield router


def test_hetero_rows_record_the_routers_decision(pd_router: str, tmp_path: Path) -> None:
    out = tmp_path / "hetero.json"
    command = [
        sys.executable, "-m", "syshax.cli", "benchmark", "--no-progress",
        "--scenario", "custom", "--input-tokens", "16", "--output-tokens", "8",
        "--concurrency", "2", "--iterations", "4", "--warmup", "0",
        "--target-hetero", pd_router, "--json", str(out), "--samples", "--sim-speed", "20",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["mode"] == "hetero"
    samples = row["requests"]
    assert [sample["decision"] for sample in samples] == ["pd"] * 4
    assert all(sample["output_tokens"] == 8 for sample in samples)
    # PD decodes on the CPU: the simulated Kunpeng's per-token latency, not the A100's.
    assert row["summary"]["tpot"]["mean"] > 30.0
