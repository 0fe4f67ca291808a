"""The generator and ``syshax benchmark`` end to end, against a real simulated engine."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.client import StreamClient, discover_model, make_session
from loadgen.runner import LoadSpec, run_async, run_load
from loadgen.wire import ConnectionPool
from loadgen.workload import arrival_offsets, build_requests

pytestmark = pytest.mark.process


def benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "syshax.cli", "benchmark", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_cli_rows_per_level_and_json(fast_sim: str, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = benchmark(
        "--scenario", "custom", "--input-tokens", "16", "--output-tokens", "12",
        "--concurrency", "1-4", "--iterations", "6", "--warmup", "2",
        "--target", fast_sim, "--json", str(out), "--samples", "--slo-ttft-ms", "60000",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| target | 4 | 6 / 0 |" in done.stdout
    document = json.loads(out.read_text())
    assert document["config"]["concurrency"] == [1, 2, 4]
    assert document["config"]["scenario"]["output_tokens"] == 12
    rows = document["rows"]
    assert [row["concurrency"] for row in rows] == [1, 2, 4]
    for row in rows:
        summary = row["summary"]
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 6 * 12  # ignore_eos gives exact lengths
        assert summary["total_input_tokens"] == 6 * 16  # one token per word on the sim
        assert summary["ttft"]["count"] == 6 and summary["ttft"]["p99"] > 0
        assert summary["itl"]["count"] == 6 * 11
        assert summary["good_requests"] == 6
        assert len(row["requests"]) == 6  # warm-up requests are not among them
        assert all(sample["output_tokens"] == 12 for sample in row["requests"])


def test_failures_are_counted_with_their_errors(fast_sim: str, tmp_path: Path) -> None:
    out = tmp_path / "bad.json"
    done = benchmark(
        "--scenario", "custom", "--input-tokens", "4", "--output-tokens", "4",
        "--concurrency", "2", "--iterations", "4", "--warmup", "0",
        "--target", fast_sim, "--model", "no-such-model", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 1
    assert "4 x HTTP 404" in done.stdout
    row = json.loads(out.read_text())["rows"][0]
    assert row["summary"]["failed"] == 4 and row["summary"]["completed"] == 0
    assert len(row["failed_requests"]) == 4
    assert all("no-such-model" in r["error"] for r in row["failed_requests"])


def test_unreachable_target_fails_every_request_not_the_run(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = benchmark(
        "--scenario", "custom", "--input-tokens", "4", "--output-tokens", "4",
        "--concurrency", "1", "--iterations", "3", "--warmup", "0",
        "--target", url, "--model", "m",
    )  # fmt: skip
    assert done.returncode == 1
    assert "| target | 1 | 0 / 3 |" in done.stdout
    assert "3 x ConnectionRefusedError" in done.stdout


def test_modes_through_per_mode_targets(fast_sim: str) -> None:
    done = benchmark(
        "--scenario", "custom", "--input-tokens", "8", "--output-tokens", "4",
        "--concurrency", "2", "--iterations", "2", "--warmup", "0", "--mode", "all",
        "--target-cpu", fast_sim, "--target-gpu", fast_sim, "--target-hetero", fast_sim,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for mode in ("cpu", "gpu", "hetero"):
        assert f"| {mode} | 2 | 2 / 0 |" in done.stdout
    assert "| 2 | throughput (tok/s) |" in done.stdout  # the ratio table


def test_deployment_needs_a_control_plane() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "syshax.cli", "benchmark", "--deployment", "qwen"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert "needs a control plane" in done.stderr


async def _generate(url: str, api: str, load: LoadSpec, count: int):  # type: ignore[no-untyped-def]
    async with make_session() as session:
        model = await discover_model(session, url)
    pool = ConnectionPool()
    try:
        client = StreamClient(pool, url, model, api=api)
        return await run_load(client, build_requests(count, 8, 6, seed=1), load)
    finally:
        pool.close()


def test_chat_api_times_content_not_the_role_chunk(fast_sim: str) -> None:
    result = run_async(_generate(fast_sim, "chat", LoadSpec(2), 4))
    assert all(record.ok for record in result.records)
    # The role chunk carries no content, so six content chunks make six tokens.
    assert [len(record.chunk_times) for record in result.records] == [6] * 4
    assert all(record.output_tokens == 6 for record in result.records)


def test_request_rate_never_sends_early(fast_sim: str) -> None:
    load = LoadSpec(concurrency=None, request_rate=20.0, burstiness=1.0, seed=5)
    result = run_async(_generate(fast_sim, "completions", load, 10))
    assert all(record.ok for record in result.records)
    planned = arrival_offsets(10, 20.0, 1.0, seed=5)
    start = result.started_at - result.wall_offset
    for record, offset in zip(result.records, planned, strict=True):
        assert record.sent_at - start >= offset - 1e-3
        # Each record knows when it was due, so a late generator is seen, not hidden.
        assert record.due_at == pytest.approx(start + offset, abs=1e-3)
        lateness = record.send_lateness
        assert lateness == pytest.approx(max(0.0, record.sent_at - record.due_at))
    assert math.isclose(planned[-1], 0.5)


def test_a_dead_target_stops_the_run_before_the_first_row() -> None:
    done = benchmark("--target", f"http://127.0.0.1:{free_port()}", "--concurrency", "1")
    assert done.returncode == 2
    assert "a target must be up" in done.stderr


def test_rate_sweep_finds_max_goodput_and_draws_it(fast_sim: str, tmp_path: Path) -> None:
    out, chart = tmp_path / "sweep.json", tmp_path / "sweep.svg"
    done = benchmark(
        "--scenario", "custom", "--input-tokens", "16", "--output-tokens", "8",
        "--request-rate", "2,4", "--iterations", "8", "--warmup", "0",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--find-max-goodput",
        "--target-gpu", fast_sim, "--json", str(out), "--chart", str(chart), "--samples",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| gpu | 2 | 8 / 0 |" in done.stdout and "| gpu | 4 | 8 / 0 |" in done.stdout
    assert "gpu: every rate met the 90% target: max goodput is at least 4" in done.stdout
    document = json.loads(out.read_text())
    assert document["config"]["request_rates"] == [2.0, 4.0]
    sweep = document["sweeps"]["gpu"]
    assert [p["rate"] for p in sweep["points"]] == [2.0, 4.0]
    assert all(p["attainment"] == 100.0 for p in sweep["points"])
    assert [row["rate"] for row in document["rows"]] == [2.0, 4.0]
    assert all(len(row["requests"]) == 8 for row in document["rows"])
    assert chart.read_text().startswith("<svg")


def test_a_sweep_no_rate_meets_says_so(fast_sim: str) -> None:
    done = benchmark(
        "--scenario", "custom", "--input-tokens", "16", "--output-tokens", "8",
        "--request-rate", "2,4", "--iterations", "4", "--warmup", "0",
        "--slo-ttft-ms", "0.001", "--target-gpu", fast_sim,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "gpu: no rate met the 90% target (best attainment 0.0%)" in done.stdout


def test_bad_sweeps_are_refused_naming_the_flag() -> None:
    base = ["--target", "http://127.0.0.1:9", "--model", "m", "--slo-ttft-ms", "100"]
    cases = {
        ("--request-rate", "4,2"): "--request-rate: rates must be strictly ascending",
        ("--request-rate", "0,2"): "--request-rate: every rate must be positive",
        ("--request-rate", "-1"): "--request-rate: every rate must be positive",
        ("--request-rate", "1,2", "--slo-attainment", "0"): "--slo-attainment must be in",
        ("--request-rate", "1,2", "--slo-attainment", "101"): "--slo-attainment must be in",
        ("--request-rate", "1,2", "--concurrency", "1-4"): "--concurrency: a rate sweep",
        ("--request-rate", "1,2", "--slo-ttft-ms", "-3"): "SLO ttft_ms must be positive",
    }
    for extra, message in cases.items():
        done = benchmark(*base, *extra)
        assert done.returncode == 2, (extra, done.stdout)
        assert message in done.stderr, (extra, done.stderr)
        assert "Traceback" not in done.stderr
    no_slo = benchmark("--target", "http://127.0.0.1:9", "--model", "m", "--request-rate", "1,2")
    assert no_slo.returncode == 2 and "a goodput sweep needs an SLO" in no_slo.stderr
