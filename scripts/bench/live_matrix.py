#!/usr/bin/env python3
"""The live matrix: generated scenarios run live and in virtual time, side by side.

Draws the matrix (``hetero.matrix.generate``: both simulated pairs, prompt-heavy, balanced
and decode-heavy shapes, SLOs around each pair's, three rates from comfortable to past the
GPU's knee, and mixed interactive + batch scenarios), then for each scenario and rate runs
GPU-only and hetero live (``syshax sim`` engines with the KV connector and ``syshax router``,
the project's load generator; ``hetero.live``) and in the virtual model, prints one table and
the targets of docs/benchmarks.md ("The live matrix"), each met or not with its worst case.

    .venv/bin/python scripts/bench/live_matrix.py --virtual-only          # the virtual side
    .venv/bin/python scripts/bench/live_matrix.py --json var/live-matrix.json
    .venv/bin/python scripts/bench/live_matrix.py --only s0-04-a10-xeon-decode-heavy \\
        --requests 20 --fixed-requests --speed 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hetero.live import (
    MIXED_REQUESTS,
    TABLE_HEAD,
    MatrixRun,
    document,
    run_matrix,
    table_row,
    targets,
)
from hetero.matrix import DEFAULT_COUNT, DEFAULT_MIXED, generate
from testbed.vllm_env import connector_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the matrix's and the arrivals'")
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="single-class scenarios")
    parser.add_argument("--mixed", type=int, default=DEFAULT_MIXED, help="mixed scenarios")
    parser.add_argument(
        "--requests",
        type=int,
        default=60,
        help="per rate and mode: at least these, more where the rate needs them to reach its "
        "steady state (hetero.matrix.steady_requests)",
    )
    parser.add_argument(
        "--fixed-requests",
        action="store_true",
        help="exactly --requests per rate and mode, steady or not (a quick look)",
    )
    parser.add_argument(
        "--mixed-requests",
        type=int,
        default=MIXED_REQUESTS,
        help="interactive requests per mixed cell (its window: these over the interactive rate)",
    )
    parser.add_argument("--speed", type=float, default=5.0, help="the simulators' --speed")
    parser.add_argument("--only", action="append", help="run this scenario id (repeatable)")
    parser.add_argument("--rates", help="comma-separated rates instead of the scenario's")
    parser.add_argument("--virtual-only", action="store_true", help="the virtual side alone")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.requests < 1 or args.speed <= 0:
        parser.error("--requests must be at least 1 and --speed positive")
    began = time.monotonic()
    scenarios = generate(args.seed, args.count, args.mixed, only=args.only)
    if args.only and len(scenarios) != len(set(args.only)):
        known = {s.id for s in scenarios}
        unknown = [i for i in args.only if i not in known]
        parser.error(f"unknown scenario {unknown[0]!r}; ids are s<seed>-NN-<pair>-<shape>")
    if args.rates:
        rates = tuple(float(r) for r in args.rates.split(","))
        scenarios = tuple(replace(s, rates=rates) for s in scenarios)
    which = "virtual" if args.virtual_only else "live"
    print(
        f"{len(scenarios)} scenarios (seed {args.seed}), {args.requests} requests per rate, "
        + ("virtual only" if args.virtual_only else f"live at --speed {args.speed:g}")
        + f"; matrix drawn in {time.monotonic() - began:.0f} s\n",
        flush=True,
    )
    print(TABLE_HEAD, flush=True)
    run = MatrixRun(
        requests=args.requests,
        steady=not args.fixed_requests,
        mixed_requests=args.mixed_requests,
        seed=args.seed,
        speed=args.speed,
        live=not args.virtual_only,
        connector=connector_config,
        on_cell=lambda cell: print(table_row(cell), flush=True),
    )
    cells = run_matrix(scenarios, run)
    print(
        "\n`*`: decode-heavy (output >= 2x prompt). Single-class: goodput (good req/s) and SLO "
        "attainment; mixed: batch good tokens/s in the window and interactive attainment.\n"
    )
    print(f"Targets, judged on the {which} results:")
    for target in targets(cells, which):
        print(target.line())
    elapsed = time.monotonic() - began
    print(f"\n{len(cells)} cells in {elapsed:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "argv": sys.argv[1:],
            "seed": args.seed,
            "requests": args.requests,
            "mixed_requests": args.mixed_requests,
            "speed": args.speed,
            "elapsed_s": elapsed,
        }
        args.json.write_text(json.dumps(document(scenarios, cells, meta), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
