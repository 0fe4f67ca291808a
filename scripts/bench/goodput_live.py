#!/usr/bin/env python3
"""The virtual-time goodput model beside the live system, at the same rates.

Starts a pair of ``syshax goodput_sweep.PAIRS`` as live simulators (the vLLM protocol with
the SyshaxShmConnector, one shared shm directory), a gpu-only router and a hetero router with
the sweep's policy in front of them, runs ``syshax benchmark --request-rate ...`` against both
routers, then the virtual model (``hetero``) at the same rates, requests and SLO, and
prints each mode's SLO attainment per rate from both side by side.

    .venv/bin/python scripts/bench/goodput_live.py --pair a10-xeon --scenario short \\
        --rates 4,8,10 --requests 120 --speed 4

The no-harm check of docs/benchmarks.md runs the router's default policy (``--policy
default``: what an operator gets, not the sweep's tuning) on a shape and SLO of its own::

    .venv/bin/python scripts/bench/goodput_live.py --pair a100-kunpeng --input-tokens 1024 \\
        --output-tokens 384 --slo-ttft-ms 3000 --slo-tpot-ms 120 --policy default \\
        --rates 0.2,0.4,0.6,0.8 --requests 48 --speed 2

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
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.policy_schema import PolicyKnobs  # noqa: E402
from common.presets import device_preset  # noqa: E402
from hetero.sweep import PAIRS, Pair, measure, pair_knobs  # noqa: E402
from loadgen.goodput import parse_rates  # noqa: E402
from loadgen.scenarios import SCENARIOS, resolve_scenario  # noqa: E402
from loadgen.simproc import (  # noqa: E402
    knob_flags_for_speed,
    running_router,
    running_sim,
)
from sim.perfmodel import bind_cpu  # noqa: E402
from testbed.vllm_env import connector_config  # noqa: E402


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
    parser.add_argument("--input-tokens", type=int, help="the scenario's prompt length instead")
    parser.add_argument("--output-tokens", type=int, help="the scenario's output length instead")
    parser.add_argument("--slo-ttft-ms", type=float, help="default: the pair's")
    parser.add_argument("--slo-tpot-ms", type=float, help="default: the pair's")
    parser.add_argument(
        "--cpu-bind",
        help="the CPU engine's cores in its preset (e.g. 0-79, one socket of the Kunpeng "
        "pair, as a deployment's NUMA placement gives it); default: the pair's",
    )
    parser.add_argument(
        "--policy",
        choices=("sweep", "default"),
        default="sweep",
        help="hetero's knobs: the sweep's tuning to the pair's SLO, or the router's defaults",
    )
    args = parser.parse_args()
    rates = parse_rates(args.rates, "--rates")
    pair = replace(
        PAIRS[args.pair],
        slo_ttft_ms=args.slo_ttft_ms or PAIRS[args.pair].slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms or PAIRS[args.pair].slo_tpot_ms,
    )
    if args.cpu_bind:
        device = bind_cpu(device_preset(pair.cpu.device.name), args.cpu_bind)
        pair = replace(pair, cpu=replace(pair.cpu, device=device))
    scenario = resolve_scenario(args.scenario, args.input_tokens, args.output_tokens)
    knobs = {
        "gpu": pair_knobs(pair, "gpu"),
        "hetero": pair_knobs(pair, "hetero") if args.policy == "sweep" else PolicyKnobs(),
    }
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
                        mode=knobs[mode].mode,
                        extra_args=knob_flags_for_speed(knobs[mode], args.speed),
                    )
                )
                for mode in ("gpu", "hetero")
            }
            command = [
                sys.executable, "-m", "syshax.cli", "benchmark", "--no-progress",
                "--scenario", scenario.name, "--iterations", str(args.requests),
                "--input-tokens", str(scenario.input_tokens),
                "--output-tokens", str(scenario.output_tokens),
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
        f"\n{args.pair}, {scenario.name} ({scenario.input_tokens} -> {scenario.output_tokens} "
        f"tokens): {args.requests} requests per rate, SLO TTFT {pair.slo_ttft_ms:g} ms / TPOT "
        f"{pair.slo_tpot_ms:g} ms, {args.policy} policy, live at --speed {args.speed:g}\n"
    )
    for mode, lines in decisions.items():
        print(f"live {mode} router's decisions:")
        for line in lines:
            print("  " + line)
    print()
    print("| mode | rate (req/s) | live: met the SLO | live attainment | virtual attainment |")
    print("|---|---|---|---|---|")
    for mode in ("gpu", "hetero"):
        points = {p["rate"]: p for p in live[mode]["points"]}
        for rate in rates:
            virtual, _ = measure(
                pair, scenario, mode, rate, requests=args.requests, knobs=knobs[mode]
            )
            shown = points.get(rate)
            live_att = f"{shown['attainment']:.1f}%" if shown else "-"
            met = f"{shown['good']} of {shown['requests']}" if shown else "-"
            print(f"| {mode} | {rate:g} | {met} | {live_att} | {virtual.attainment:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
