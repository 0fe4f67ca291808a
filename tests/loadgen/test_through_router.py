"""The generator through ``syshax router`` in front of a CPU and a GPU simulated engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.simproc import running_router, running_sim

SYSHAX = ("--syshax-compat",)
BENCHMARK = ("--benchmark-key", "sxk_bench")


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


@pytest.mark.process
def test_the_benchmark_sends_a_routers_api_key_from_its_environment(tmp_path: Path) -> None:
    with (
        running_sim("a100-80gb", speed=20.0) as gpu,
        running_router(
            gpu, gpu, mode="gpu-only", extra_args=("--api-key", "sxk_test", *BENCHMARK)
        ) as router,
    ):
        command = [
            sys.executable, "-m", "syshax.cli", "benchmark", "--no-progress",
            "--scenario", "custom", "--input-tokens", "8", "--output-tokens", "4",
            "--concurrency", "1", "--iterations", "2", "--warmup", "0", "--target", router,
            "--mode", "gpu", "--json", str(tmp_path / "out.json"),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYSHAX_ROUTER_")}
        refused = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert refused.returncode == 2 and "HTTP 401" in refused.stderr, refused.stderr
        env["SYSHAX_ROUTER_API_KEY"] = "sxk_test"
        # --mode gpu forces the router's mode: the benchmark key is sent for that.
        env["SYSHAX_ROUTER_BENCHMARK_KEY"] = "sxk_bench"
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["rows"][0]["summary"]["completed"] == 2
    assert "sxk_test" not in json.dumps(document) and "sxk_bench" not in json.dumps(document)


def test_the_json_results_leave_secret_flags_out() -> None:
    from loadgen.cli import _without_secrets

    argv = ["--target", "http://r", "--api-key", "sxk_a", "--token=sxp_b", "--mode", "gpu"]
    assert _without_secrets(argv) == [
        "--target", "http://r", "--api-key", "***", "--token=***", "--mode", "gpu",
    ]  # fmt: skip
