#!/usr/bin/env python3
"""Goodput at SLO of the benchmark pairs, side by side, in one command.

For each pair (``hetero.sweep.PAIRS``) and scenario, sweeps the request rate for GPU
alone, CPU alone, hetero with the default policy and hetero with sysHAX's threshold policy,
on the same simulated engines in virtual time (``hetero.virtual``: the simulator's
batch schedulers and the router's own deciders), finds each mode's max goodput by bisection,
and prints:

- the derivation of the scenario's saturation from the presets;
- the sweep table (SLO attainment, goodput, throughput per rate and mode);
- hetero / GPU max goodput, and hetero as a fraction of the physical bound (GPU-alone max
  goodput + CPU-alone max goodput);
- no harm: the lowest hetero / GPU goodput over every rate swept.

    .venv/bin/python scripts/bench/goodput_sweep.py                      # everything, ~10 min
    .venv/bin/python scripts/bench/goodput_sweep.py --pair a10-xeon --scenario decode-heavy
    .venv/bin/python scripts/bench/goodput_sweep.py --out var/goodput    # + SVG charts and JSON

``--mixed`` runs the mixed-traffic benchmark instead (docs/benchmarks.md, "Mixed traffic"):
interactive and batch traffic together (``loadgen.scenarios.MIXED_SCENARIOS``), the
interactive rate held at GPU-only's 99 % limit, and per mode (``gpu`` with priority
scheduling, ``class-blind`` and ``class-aware`` hetero) the highest batch rate with
interactive traffic still at 99 % of its SLO, with each class's goodput there: interactive
SLO attainment, batch tokens/s within the batch targets, both classes' TTFT and TPOT. It is
``scripts/bench/mixed_traffic.py`` itself (its ``main``, on ``hetero.mixed``), so every
other argument is that script's (``--pair``, ``--traffic``, ``--seeds``,
``--requests``, ``--bisections``, ``--warmup``, ``--jobs``, ``--quick``, ``--out``):

    .venv/bin/python scripts/bench/goodput_sweep.py --mixed --out var/mixed   # both pairs, 3 seeds
    .venv/bin/python scripts/bench/goodput_sweep.py --mixed --quick           # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hetero.sweep import MODES, PAIRS, default_rates, derivation, sweep
from loadgen.chart import sweep_svg
from loadgen.goodput import GoodputSearch, format_sweeps, parse_rates
from loadgen.scenarios import SCENARIOS

# Where hetero may not fall below GPU-only goodput at any rate (issue target: 2 %).
NO_HARM = 0.98


def _one(job: tuple[str, str, str, tuple[float, ...], int, float, int]) -> dict[str, object]:
    pair_name, scenario_name, mode, rates, requests, target, bisections = job
    search, runs = sweep(
        PAIRS[pair_name],
        SCENARIOS[scenario_name],
        mode,
        rates,
        requests=requests,
        target=target,
        bisections=bisections,
    )
    decisions: dict[str, dict[str, int]] = {
        f"{rate:g}": dict(stats.decisions.most_common()) for rate, stats in runs.items()
    }
    preemptions = {f"{rate:g}": stats.preemptions for rate, stats in runs.items()}
    return {
        "pair": pair_name,
        "scenario": scenario_name,
        "mode": mode,
        "search": search,
        "decisions": decisions,
        "preemptions": preemptions,
    }


MIXED_FLAG = "--mixed"


def run_mixed(argv: Sequence[str]) -> int:
    """The mixed-traffic benchmark: ``scripts/bench/mixed_traffic.py``'s ``main`` with
    ``argv`` as its arguments (its usage line names this command)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import mixed_traffic  # the script beside this one; imported here, so plain sweeps skip it

    saved = sys.argv
    sys.argv = [f"{Path(__file__).name} {MIXED_FLAG}", *argv]
    try:
        return int(mixed_traffic.main())
    finally:
        sys.argv = saved


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if MIXED_FLAG in argv:
        return run_mixed([arg for arg in argv if arg != MIXED_FLAG])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        MIXED_FLAG,
        action="store_true",
        help="run the mixed-traffic benchmark (interactive beside batch, goodput per class); "
        "every other argument is then scripts/bench/mixed_traffic.py's",
    )
    parser.add_argument("--pair", action="append", choices=sorted(PAIRS), help="default: all")
    parser.add_argument(
        "--scenario", action="append", choices=sorted(SCENARIOS), help="default: all"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rates", help="one sweep for every pair (default: derived per pair)")
    parser.add_argument("--requests", type=int, default=600, help="requests per rate")
    parser.add_argument("--slo-attainment", type=float, default=90.0)
    parser.add_argument("--bisections", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, help="write charts (SVG) and results (JSON) here")
    args = parser.parse_args(argv)
    try:
        rates_override = parse_rates(args.rates, "--rates") if args.rates else None
    except ValueError as exc:
        parser.error(str(exc))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    pairs = args.pair or list(PAIRS)
    scenarios = args.scenario or list(SCENARIOS)
    jobs = []
    plans: dict[tuple[str, str], tuple[float, ...]] = {}
    for pair_name in pairs:
        for scenario_name in scenarios:
            rates = rates_override or default_rates(PAIRS[pair_name], SCENARIOS[scenario_name])
            plans[(pair_name, scenario_name)] = rates
            for mode in modes:
                jobs.append(
                    (
                        pair_name,
                        scenario_name,
                        mode,
                        rates,
                        args.requests,
                        args.slo_attainment,
                        args.bisections,
                    )
                )
    began = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(_one, jobs))
    by_key: dict[tuple[str, str], dict[str, GoodputSearch]] = {}
    extra: dict[tuple[str, str], dict[str, dict[str, object]]] = {}
    for result in results:
        key = (str(result["pair"]), str(result["scenario"]))
        search = result["search"]
        assert isinstance(search, GoodputSearch)
        by_key.setdefault(key, {})[str(result["mode"])] = search
        extra.setdefault(key, {})[str(result["mode"])] = {
            "decisions": result["decisions"],
            "preemptions": result["preemptions"],
        }
    summary: list[str] = [
        "| pair | scenario | GPU | CPU | hetero | syshax-threshold | hetero/GPU "
        "| threshold/GPU | hetero/bound | worst hetero/GPU goodput | largest shortfall (req/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    document: dict[str, object] = {"requests_per_rate": args.requests, "results": []}
    for (pair_name, scenario_name), searches in by_key.items():
        pair = PAIRS[pair_name]
        scenario = SCENARIOS[scenario_name]
        print(
            f"\n## {pair_name}, {scenario_name} ({scenario.input_tokens} -> "
            f"{scenario.output_tokens} tokens)\n"
        )
        print(
            f"SLO: TTFT <= {pair.slo_ttft_ms:g} ms, TPOT <= {pair.slo_tpot_ms:g} ms, "
            f"{args.slo_attainment:g}% of requests; {args.requests} requests per rate\n"
        )
        for line in derivation(pair, scenario):
            print(f"- {line}")
        print()
        print(format_sweeps(searches))
        best = {mode: s.max_goodput_rate for mode, s in searches.items()}

        def ratio(top: float | None, base: float | None) -> str:
            return f"{top / base:.2f}x" if top is not None and base else "-"

        bound = None
        if best.get("gpu") is not None:
            bound = (best.get("gpu") or 0.0) + (best.get("cpu") or 0.0)
        worst = shortfall = "-"
        if "hetero" in searches and "gpu" in searches:
            gpu_points = {p.rate: p for p in searches["gpu"].points}
            pairs = [
                (p, gpu_points[p.rate]) for p in searches["hetero"].points if p.rate in gpu_points
            ]
            ratios = [(h.goodput / g.goodput, h.rate) for h, g in pairs if g.goodput > 0]
            if ratios:
                low, at = min(ratios)
                flag = "" if low >= NO_HARM else " (below 0.98)"
                worst = f"{low:.3f} at {at:g} req/s{flag}"
            gaps = [(g.goodput - h.goodput, h.rate) for h, g in pairs]
            if gaps:
                gap, at = max(gaps)
                shortfall = f"{max(gap, 0.0):.3f} at {at:g}" if gap > 0 else "none"
        cells = [
            pair_name,
            scenario_name,
            *(f"{best[m]:g}" if best.get(m) is not None else "-" for m in MODES),
            ratio(best.get("hetero"), best.get("gpu")),
            ratio(best.get("syshax-threshold"), best.get("gpu")),
            ratio(best.get("hetero"), bound),
            worst,
            shortfall,
        ]
        summary.append("| " + " | ".join(cells) + " |")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            svg = args.out / f"goodput-{pair_name}-{scenario_name}.svg"
            svg.write_text(sweep_svg(searches, f"{pair_name}, {scenario_name}"))
            print(f"\nchart: {svg}")
        results_list = document["results"]
        assert isinstance(results_list, list)
        results_list.append(
            {
                "pair": pair_name,
                "scenario": scenario.to_dict(),
                "slo_ms": {"ttft": pair.slo_ttft_ms, "tpot": pair.slo_tpot_ms},
                "rates": list(plans[(pair_name, scenario_name)]),
                "modes": {
                    mode: {**s.to_dict(), **extra[(pair_name, scenario_name)][mode]}
                    for mode, s in searches.items()
                },
            }
        )
    print("\n## Max goodput (req/s at the SLO attainment target)\n")
    print("\n".join(summary))
    print(f"\n{len(jobs)} sweeps in {time.monotonic() - began:.0f} s")
    if args.out:
        path = args.out / "goodput.json"
        path.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
