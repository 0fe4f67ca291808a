#!/usr/bin/env python3
"""Mixed traffic: batch work beside interactive traffic held at the GPU's limit, per mode.

For each pair (``hetero.sweep.PAIRS``) and seed, in virtual time (``hetero.mixed``):

1. the interactive rate: GPU-only's max goodput on interactive traffic alone at 99 % SLO
   attainment (the existing bisection);
2. for each mode (``gpu`` with priority scheduling, ``class-blind`` hetero, ``class-aware``
   hetero; every engine schedules by priority), the highest batch rate at which interactive
   traffic still meets its SLO for 99 % of requests, and what was delivered there: batch
   tokens/s = output tokens received within the measured (interactive) window by batch
   requests that completed within the batch class's targets, per second of that window
   (requests go through the router's flow control, so the batch load offered may exceed it).

Prints a table per pair (the median seed's run of each mode) and the ratios class-aware /
GPU-only and class-aware / class-blind (medians over seeds); ``--out DIR`` writes JSON.

    .venv/bin/python scripts/bench/mixed_traffic.py                   # both pairs, 3 seeds
    .venv/bin/python scripts/bench/mixed_traffic.py --pair a10-xeon --seeds 0
    .venv/bin/python scripts/bench/mixed_traffic.py --quick           # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hetero.mixed import (
    BATCH_TPOT_FACTOR,
    INTERACTIVE_ATTAINMENT,
    MIXED_MODES,
    BatchSearch,
    MixedResult,
    batch_search,
    batch_tokens_per_s,
    interactive_rate,
    median,
    median_seed,
    mixed_knobs,
    ratio,
    warmup_seconds,
)
from hetero.sweep import PAIRS
from loadgen.goodput import GoodputSearch
from loadgen.scenarios import MIXED_SCENARIOS

# The targets: class-aware carries this multiple of GPU-only's batch tokens/s, and
# more than class-blind.
TARGET_OVER_GPU = 1.5
MAX_JOBS = 2  # this machine has 2 cores


def _interactive(job: tuple[str, str, int, int, int]) -> tuple[str, int, GoodputSearch]:
    pair, traffic, seed, requests, bisections = job
    search = interactive_rate(
        PAIRS[pair], MIXED_SCENARIOS[traffic], requests=requests, seed=seed, bisections=bisections
    )
    return pair, seed, search


def _batch(
    job: tuple[str, str, int, str, float, int, int, float | None],
) -> tuple[str, int, BatchSearch]:
    pair, traffic, seed, mode, rate, requests, bisections, warmup = job
    search = batch_search(
        PAIRS[pair],
        MIXED_SCENARIOS[traffic],
        mode,
        rate,
        requests=requests,
        seed=seed,
        bisections=bisections,
        warmup_s=warmup,
    )
    return pair, seed, search


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _x(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", action="append", choices=sorted(PAIRS), help="default: all")
    parser.add_argument("--traffic", default="chat-and-batch", choices=sorted(MIXED_SCENARIOS))
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated; medians are quoted")
    parser.add_argument(
        "--requests", type=int, default=1000, help="interactive requests per run (the window)"
    )
    parser.add_argument("--bisections", type=int, default=4)
    parser.add_argument(
        "--warmup", type=float, help="seconds of batch-only load first (default: per pair)"
    )
    parser.add_argument("--jobs", type=int, default=MAX_JOBS)
    parser.add_argument("--quick", action="store_true", help="tiny runs: a smoke test")
    parser.add_argument("--out", type=Path, help="write mixed-traffic.json here")
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: not a list of integers: {args.seeds!r}")
    if not seeds:
        parser.error("--seeds: at least one seed")
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    if args.quick:
        args.requests, args.bisections, seeds = 40, 0, seeds[:1]
        args.warmup = 30.0 if args.warmup is None else args.warmup
    pairs = args.pair or list(PAIRS)
    traffic = MIXED_SCENARIOS[args.traffic]
    jobs = max(1, min(args.jobs, MAX_JOBS))
    began = time.monotonic()
    rates: dict[tuple[str, int], GoodputSearch] = {}
    found: dict[tuple[str, int], dict[str, BatchSearch]] = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        first = [(p, args.traffic, s, args.requests, args.bisections) for p in pairs for s in seeds]
        for name, seed, search in pool.map(_interactive, first):
            rates[(name, seed)] = search
        second = []
        for (name, seed), search in rates.items():
            rate = search.max_goodput_rate
            if rate is None:
                print(f"{name}, seed {seed}: GPU-only met no interactive rate: {search.verdict()}")
                continue
            for mode in MIXED_MODES:
                second.append(
                    (
                        name,
                        args.traffic,
                        seed,
                        mode,
                        rate,
                        args.requests,
                        args.bisections,
                        args.warmup,
                    )
                )
        for name, seed, found_search in pool.map(_batch, second):
            found.setdefault((name, seed), {})[found_search.mode] = found_search
    results: dict[str, list[MixedResult]] = {}
    for (name, seed), searches in found.items():
        results.setdefault(name, []).append(MixedResult(name, seed, rates[(name, seed)], searches))
    document: dict[str, object] = {
        "traffic": traffic.to_dict(),
        "seeds": seeds,
        "requests": args.requests,
        "bisections": args.bisections,
        "interactive_attainment": INTERACTIVE_ATTAINMENT,
        "batch_tpot_factor": BATCH_TPOT_FACTOR,
        "argv": sys.argv[1:],
        "pairs": [],
    }
    summary = [
        "| pair | interactive rate (req/s) | GPU-only | class-blind | class-aware "
        "| aware / GPU | aware / blind | targets |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pair_name in pairs:
        runs = sorted(results.get(pair_name, []), key=lambda r: r.seed)
        if not runs:
            continue
        pair = PAIRS[pair_name]
        knobs = mixed_knobs(pair, "class-aware")
        interactive = traffic.for_class("interactive")
        batch = traffic.for_class("batch")
        rate_median = median([r.interactive.max_goodput_rate or 0.0 for r in runs])
        print(f"\n## {pair_name}: {pair.note}\n")
        print(
            f"interactive {interactive.input_tokens} -> {interactive.output_tokens} tokens, "
            f"TTFT <= {knobs.interactive_ttft_ms:g} ms, TPOT <= {knobs.interactive_tpot_ms:g} ms; "
            f"batch {batch.input_tokens} -> {batch.output_tokens} tokens, TTFT <= "
            f"{knobs.batch_ttft_ms:g} ms, TPOT <= {knobs.batch_tpot_ms:g} ms; "
            f"interactive rate (GPU-only alone at {INTERACTIVE_ATTAINMENT:g} %): "
            + " / ".join(f"{r.interactive.max_goodput_rate:g}" for r in runs)
            + f" req/s (seeds {', '.join(str(r.seed) for r in runs)}); "
            f"{args.requests} interactive requests per run after "
            f"{args.warmup if args.warmup is not None else warmup_seconds(pair, traffic):g} s "
            "of batch alone\n"
        )
        print(
            "| mode | batch rate offered (req/s) | batch tokens/s | per seed "
            "| batch offered tokens/s | batch SLO met | batch queued / shed | batch on CPU "
            "| interactive SLO met | interactive TTFT p50 / p99 (ms) "
            "| interactive TPOT p50 / p99 (ms) | batch TTFT p50 / p99 (ms) "
            "| batch TPOT p50 / p99 (ms) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        modes_doc: dict[str, object] = {}
        for mode in MIXED_MODES:
            run = median_seed(runs, mode)
            best = run.searches[mode].best
            per_seed = " / ".join(f"{batch_tokens_per_s(r, mode):.0f}" for r in runs)
            if best is None:
                print(f"| {mode} | 0 | 0 | {per_seed} | - | - | - | - | - | - | - | - | - |")
            else:
                i, b = best.interactive, best.batch
                cpu = 100.0 * b.cpu_tokens / b.tokens if b.tokens else 0.0
                offered = best.load.batch_rate * traffic.for_class("batch").output_tokens
                print(
                    f"| {mode} | {best.load.batch_rate:g} | {b.window_good_tokens_per_s:.1f} "
                    f"| {per_seed} | {offered:.1f} | {b.attainment:.1f} % "
                    f"| {b.queued} / {b.shed} of {b.requests} | {cpu:.0f} % "
                    f"| {i.attainment:.1f} % | {_ms(i.ttft_p50_ms)} / {_ms(i.ttft_p99_ms)} "
                    f"| {_ms(i.tpot_p50_ms)} / {_ms(i.tpot_p99_ms)} "
                    f"| {_ms(b.ttft_p50_ms)} / {_ms(b.ttft_p99_ms)} "
                    f"| {_ms(b.tpot_p50_ms)} / {_ms(b.tpot_p99_ms)} |"
                )
            modes_doc[mode] = {
                "median_seed": run.seed,
                "batch_tokens_per_s": median([batch_tokens_per_s(r, mode) for r in runs]),
            }
        over_gpu = median(
            [
                ratio(batch_tokens_per_s(r, "class-aware"), batch_tokens_per_s(r, "gpu"))
                for r in runs
            ]
        )
        over_blind = median(
            [
                ratio(batch_tokens_per_s(r, "class-aware"), batch_tokens_per_s(r, "class-blind"))
                for r in runs
            ]
        )
        met = over_gpu >= TARGET_OVER_GPU and over_blind > 1.0
        print(
            f"\nclass-aware / GPU-only batch tokens/s: {_x(over_gpu)} (target >= "
            f"{TARGET_OVER_GPU:g}x); class-aware / class-blind: {_x(over_blind)} (target > 1); "
            f"medians over seeds: {'met' if met else 'NOT met'}"
        )
        tokens = {m: median([batch_tokens_per_s(r, m) for r in runs]) for m in MIXED_MODES}
        summary.append(
            f"| {pair_name} | {rate_median:g} | {tokens['gpu']:.1f} | {tokens['class-blind']:.1f} "
            f"| {tokens['class-aware']:.1f} | {_x(over_gpu)} | {_x(over_blind)} "
            f"| {'met' if met else 'not met'} |"
        )
        pairs_doc = document["pairs"]
        assert isinstance(pairs_doc, list)
        pairs_doc.append(
            {
                "pair": pair_name,
                "slo_ms": {
                    "interactive": {
                        "ttft": knobs.interactive_ttft_ms,
                        "tpot": knobs.interactive_tpot_ms,
                    },
                    "batch": {"ttft": knobs.batch_ttft_ms, "tpot": knobs.batch_tpot_ms},
                },
                "medians": {
                    "interactive_rate": rate_median,
                    "modes": modes_doc,
                    "class_aware_over_gpu": over_gpu,
                    "class_aware_over_class_blind": over_blind,
                    "targets_met": met,
                },
                "runs": [r.to_dict() for r in runs],
            }
        )
    print("\n## Batch tokens/s with interactive traffic at >= 99 % of its SLO (medians)\n")
    print("\n".join(summary))
    print(f"\n{len(seeds)} seed(s), {len(pairs)} pair(s) in {time.monotonic() - began:.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "mixed-traffic.json"
        path.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
