#!/usr/bin/env python3
"""MISSION.md's scenarios in CPU, GPU and hetero mode on simulated engines, with one command.

Starts a simulated Kunpeng 920 7280Z and a simulated A100 80GB, both serving
DeepSeek-R1-Distill-Qwen-32B q4_0, puts three standalone routers in front of the same two
engines (policy mode ``cpu-only``, ``gpu-only``, and ``--hetero-policy`` for hetero), and runs
``syshax benchmark`` against them, so the tables of docs/benchmarks.md can be regenerated:

    .venv/bin/python scripts/bench/loadgen_sim_modes.py --scenario short --iterations 16 --speed 2

``--direct`` skips the routers and benchmarks the CPU and GPU engines themselves (no hetero).
The simulators run ``--speed`` times faster than real time and the benchmark reports in
simulated time (``--sim-speed``); the routers' own clocks are scaled to match. Extra
arguments after ``--`` go to ``syshax benchmark``.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys

from common.policy_schema import PolicyKnobs
from loadgen.simproc import (
    DEFAULT_MODEL,
    SPEED_SCALED_KNOBS,
    knob_flags_for_speed,
    running_router,
    running_sim,
)

SYSHAX = ("--syshax-compat",)  # the router's PD speaks sysHAX's protocol


def scaled_knobs(speed: float) -> list[str]:
    """The default policy's router flags for engines at ``speed`` (``knob_flags_for_speed``:
    the latency knobs compare with the engines' simulated-time metrics and stay as they are;
    the router's own clocks and throughput scale)."""
    if speed == 1.0:
        return []
    return knob_flags_for_speed(PolicyKnobs(), speed, only=SPEED_SCALED_KNOBS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="short")
    parser.add_argument("--concurrency", help="default: the scenario's range")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--speed", type=float, default=2.0)
    parser.add_argument("--cpu-device", default="kunpeng-920-7280z")
    parser.add_argument("--gpu-device", default="a100-80gb")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--json", help="write the benchmark's JSON here")
    parser.add_argument("--direct", action="store_true", help="no routers, no hetero mode")
    parser.add_argument("--modes", default="cpu,gpu,hetero", help="which modes to run")
    parser.add_argument(
        "--hetero-policy", default="auto", choices=["auto", "forced-pd"], help="hetero router mode"
    )
    parser.add_argument("rest", nargs="*", help="after --: more syshax benchmark arguments")
    args = parser.parse_args()
    with (
        running_sim(args.cpu_device, args.model, speed=args.speed, extra_args=SYSHAX) as cpu_url,
        running_sim(args.gpu_device, args.model, speed=args.speed, extra_args=SYSHAX) as gpu_url,
    ):
        if args.direct:
            engines = {"cpu": cpu_url, "gpu": gpu_url}
            return benchmark(args, {m: u for m, u in engines.items() if m in args.modes.split(",")})
        knobs = scaled_knobs(args.speed)
        policy = {"cpu": "cpu-only", "gpu": "gpu-only", "hetero": args.hetero_policy}
        modes = [mode for mode in policy if mode in args.modes.split(",")]
        with contextlib.ExitStack() as stack:
            targets = {
                mode: stack.enter_context(
                    running_router(gpu_url, cpu_url, mode=policy[mode], extra_args=knobs)
                )
                for mode in modes
            }
            return benchmark(args, targets)


def benchmark(args: argparse.Namespace, targets: dict[str, str]) -> int:
    command = [
        sys.executable, "-m", "syshax.cli", "benchmark",
        "--scenario", args.scenario, "--iterations", str(args.iterations),
        "--sim-speed", str(args.speed),
    ]  # fmt: skip
    for mode, url in targets.items():
        command += [f"--target-{mode}", url]
    if args.concurrency:
        command += ["--concurrency", args.concurrency]
    if args.json:
        command += ["--json", args.json]
    command += args.rest
    print("$ syshax " + " ".join(command[3:]), flush=True)
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
