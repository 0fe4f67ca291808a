#!/usr/bin/env python3
"""The virtual-time goodput model beside the live system, at the same rates.

Starts a pair of ``syshax goodput_sweep.PAIRS`` as live simulators (the vLLM protocol with
the SyshaxShmConnector, one shared shm directory), a gpu-only router and a hetero router with
the sweep's policy in front of them, runs ``syshax benchmark --request-rate ...`` against both
routers, then the virtual model (``syshax.hetero``) at the same rates, requests and SLO, and
prints each mode's SLO attainment per rate from both side by side.

    .venv/bin/python scripts/goodput_live.py --pair a10-xeon --scenario short \\
        --rates 4,8,10 --requests 120 --speed 4

The live figures carry what the virtual ones leave out (HTTP, the router's own CPU, timer
noise at ``--speed``), on a 2-core machine that also runs the load generator, so they are a
check of the model's shape, not a second benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from syshax.hetero.sweep import PAIRS, Pair, measure, pair_knobs  # noqa: E402
from syshax.loadgen.goodput import parse_rates  # noqa: E402
from syshax.loadgen.scenarios import SCENARIOS  # noqa: E402
from syshax.loadgen.simproc import (  # noqa: E402
    knob_flags_for_speed,
    running_router,
    running_sim,
)
from tests.realengine.vllm_env import connector_config  # noqa: E402


def engine_args(pair: Pair, role: str, shm: Path) -> list[str]:
    config = pair.gpu if role == "gpu" else pair.cpu
    args = [
        "--max-num-seqs", str(config.max_num_seqs),
        "--kv-transfer-config", connector_config(role, "cpu" if role == "gpu" else "gpu", shm),
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if role == "cpu":
        args += ["--kv-cache-space", f"{config.kv_cache_space_gb:g}"]
        # The pair's CPU preset is already bound to these cores (``bind_cpu``).
        args += ["--cpu-bind", f"0-{config.device.cores - 1}"]
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="a10-xeon", choices=sorted(PAIRS))
    parser.add_argument("--scenario", default="short", choices=sorted(SCENARIOS))
    parser.add_argument("--rates", required=True)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--speed", type=float, default=4.0)
    args = parser.parse_args()
    rates = parse_rates(args.rates, "--rates")
    pair, scenario = PAIRS[args.pair], SCENARIOS[args.scenario]
    with tempfile.TemporaryDirectory(prefix="syshax-goodput-") as tmp:
        shm = Path(tmp) / "shm"
        shm.mkdir()
        out = Path(tmp) / "live.json"
        with contextlib.ExitStack() as stack:
            gpu, cpu = (
                stack.enter_context(
                    running_sim(
                        config.device.name,
                        config.model.name,
                        speed=args.speed,
                        extra_args=engine_args(pair, role, shm),
                    )
                )
                for role, config in (("gpu", pair.gpu), ("cpu", pair.cpu))
            )
            routers = {
                mode: stack.enter_context(
                    running_router(
                        gpu,
                        cpu,
                        mode=pair_knobs(pair, mode).mode,
                        extra_args=knob_flags_for_speed(pair_knobs(pair, mode), args.speed),
                    )
                )
                for mode in ("gpu", "hetero")
            }
            command = [
                sys.executable, "-m", "syshax.cli", "benchmark", "--no-progress",
                "--scenario", scenario.name, "--iterations", str(args.requests),
                "--request-rate", ",".join(f"{r:g}" for r in rates),
                "--slo-ttft-ms", f"{pair.slo_ttft_ms:g}", "--slo-tpot-ms", f"{pair.slo_tpot_ms:g}",
                "--sim-speed", f"{args.speed:g}", "--json", str(out),
                "--target-gpu", routers["gpu"], "--target-hetero", routers["hetero"],
            ]  # fmt: skip
            print("$ syshax " + " ".join(command[3:]), flush=True)
            done = subprocess.run(command, check=False, capture_output=True, text=True)
            if done.returncode not in (0, 1):
                print(done.stdout + done.stderr, file=sys.stderr)
                return done.returncode
            decisions = {
                mode: [
                    line
                    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                    if line.startswith("syshax_router_decisions_total{")
                    and not line.endswith(" 0.0")
                ]
                for mode, url in routers.items()
            }
        live = json.loads(out.read_text())["sweeps"]
    print(
        f"\n{args.pair}, {scenario.name}: {args.requests} requests per rate, SLO TTFT "
        f"{pair.slo_ttft_ms:g} ms / TPOT {pair.slo_tpot_ms:g} ms, live at --speed {args.speed:g}\n"
    )
    for mode, lines in decisions.items():
        print(f"live {mode} router's decisions:")
        for line in lines:
            print("  " + line)
    print()
    print("| mode | rate (req/s) | live attainment | virtual attainment |")
    print("|---|---|---|---|")
    for mode in ("gpu", "hetero"):
        points = {p["rate"]: p for p in live[mode]["points"]}
        for rate in rates:
            virtual, _ = measure(pair, scenario, mode, rate, requests=args.requests)
            shown = points.get(rate)
            live_att = f"{shown['attainment']:.1f}%" if shown else "-"
            print(f"| {mode} | {rate:g} | {live_att} | {virtual.attainment:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
