"""``syshax benchmark``: run a scenario against one or more targets and print the table.

Example: ``syshax benchmark --scenario short --concurrency 1-16 --iterations 100
--target-gpu http://gpu:7001 --target-cpu http://cpu:7002 --json short.json``.

A mixed scenario (``--scenario chat-and-batch``, ``loadgen.scenarios.MIXED_SCENARIOS``) draws
each request's SLO class by the scenario's shares, sends it as OpenAI's ``service_tier``, and
reports every class against its own SLO as well (docs/benchmarks.md, "Mixed scenarios, live").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from loadgen.chart import sweep_svg
from loadgen.client import (
    APIS,
    StreamClient,
    TargetUnavailable,
    discover_model,
    make_session,
)
from loadgen.controlplane import ControlPlane, ControlPlaneError
from loadgen.goodput import (
    DEFAULT_ATTAINMENT,
    DEFAULT_BISECTIONS,
    GoodputSearch,
    check_attainment,
    format_sweeps,
    parse_rates,
    ratio_line,
)
from loadgen.progress import ProgressBar
from loadgen.report import (
    Row,
    format_class_slos,
    format_classes,
    format_errors,
    format_ratios,
    format_resources,
    format_table,
    to_json,
)
from loadgen.runner import LoadSpec, run_async, run_load, use_realtime_priority
from loadgen.scenarios import (
    MIXED_SCENARIOS,
    SCENARIOS,
    SERVICE_TIERS,
    MixedScenario,
    Scenario,
    parse_concurrency,
    resolve_scenario,
)
from loadgen.stats import (
    BATCH_TPOT_FACTOR,
    BATCH_TTFT_MS,
    SLO,
    class_slos,
    combined_goodput,
    summarize,
    summarize_classes,
)
from loadgen.sweeping import Closer, OnDone, SweepPlan, sweep_target
from loadgen.targets import BENCHMARK_MODES, MODE_CHOICES, Target, plan_targets
from loadgen.wire import ConnectionPool
from loadgen.workload import WARMUP_INDEX, RequestSpec, build_mixed_requests, build_requests

CONTROL_PLANE_ENV = "SYSHAX_CONTROL_PLANE_URL"
API_KEY_ENV = "SYSHAX_ROUTER_API_KEY"
# A router's benchmark key: only its holders may force a mode (X-Syshax-Mode, docs/router.md).
BENCHMARK_KEY_ENV = "SYSHAX_ROUTER_BENCHMARK_KEY"
# Flags whose values are secrets: not copied into the JSON results.
_SECRET_FLAGS = ("--token", "--api-key")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    shape = parser.add_argument_group("what to send")
    shape.add_argument(
        "--scenario",
        default="short",
        choices=[*SCENARIOS, "custom", *MIXED_SCENARIOS],
        help="a request shape, or a mixed scenario of SLO classes ("
        + ", ".join(MIXED_SCENARIOS)
        + "): each request's class drawn by its shares and sent as service_tier",
    )
    shape.add_argument("--input-tokens", type=int, help="override the scenario's prompt length")
    shape.add_argument("--output-tokens", type=int, help="override the scenario's output length")
    shape.add_argument(
        "--concurrency",
        help="level(s): 8, a list 1,2,4,8 or a range 1-8 (doubling: 1,2,4,8); "
        "default: the scenario's range",
    )
    shape.add_argument("--iterations", type=int, default=100, help="measured requests per row")
    shape.add_argument(
        "--warmup", type=int, help="unmeasured requests before each row (default: one per slot)"
    )
    shape.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s with gamma-distributed gaps; inf = closed loop at the concurrency; "
        "an ascending list 1,2,4,8 sweeps the rates for goodput at the SLOs",
    )
    shape.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier"
    )
    shape.add_argument("--seed", type=int, default=0)
    shape.add_argument("--api", choices=APIS, default="completions")
    shape.add_argument("--model", help="model name to send (default: the target's first model)")

    where = parser.add_argument_group("where to send it (see docs/benchmarks.md)")
    where.add_argument("--target", help="base URL of a router (modes forced per request) or engine")
    for mode in BENCHMARK_MODES:
        where.add_argument(f"--target-{mode}", help=f"base URL serving the {mode} mode directly")
    where.add_argument("--deployment", help="a deployment of the control plane")
    where.add_argument(
        "--control-plane",
        default=os.environ.get(CONTROL_PLANE_ENV),
        help=f"control plane URL (env {CONTROL_PLANE_ENV})",
    )
    where.add_argument(
        "--token",
        default=os.environ.get("SYSHAX_TOKEN"),
        help="a user's API token for the control plane (env SYSHAX_TOKEN)",
    )
    where.add_argument(
        "--api-key",
        help=f"the router's key, sent to every target as 'Authorization: Bearer KEY' (default: "
        f"env {BENCHMARK_KEY_ENV} for a router whose modes are forced, else {API_KEY_ENV}; the "
        "environment keeps it off the command line)",
    )
    where.add_argument("--mode", choices=MODE_CHOICES, help="default: the modes given targets")

    out = parser.add_argument_group("results")
    out.add_argument("--json", type=Path, help="write all figures and the configuration here")
    out.add_argument("--samples", action="store_true", help="add per-request rows to the JSON")
    out.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT bound")
    out.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT bound")
    out.add_argument("--slo-e2e-ms", type=float, help="goodput: end-to-end bound")
    out.add_argument(
        "--batch-slo-ttft-ms",
        type=float,
        help=f"a mixed scenario's batch class: TTFT bound (default {BATCH_TTFT_MS:g}, the "
        "policy's batch class; the --slo-* bounds judge the other classes)",
    )
    out.add_argument(
        "--batch-slo-tpot-ms",
        type=float,
        help=f"a mixed scenario's batch class: TPOT bound (default {BATCH_TPOT_FACTOR:g} x "
        "--slo-tpot-ms)",
    )
    out.add_argument(
        "--slo-attainment",
        type=float,
        default=DEFAULT_ATTAINMENT,
        help="percent of requests that must meet the SLOs for a rate to count (sweeps)",
    )
    out.add_argument(
        "--find-max-goodput",
        action="store_true",
        help="after the sweep, bisect between the last rate meeting the target and the first "
        "missing it",
    )
    out.add_argument("--chart", type=Path, help="write the sweep's SVG chart here")
    out.add_argument(
        "--sim-speed",
        type=float,
        default=1.0,
        help="the targets are simulators at this --speed: report in simulated time",
    )
    out.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument(
        "--realtime",
        action="store_true",
        help="run the generator at SCHED_FIFO priority (if permitted) for timing on a busy host",
    )
    out.add_argument(
        "--busy-poll",
        action="store_true",
        help="spin instead of sleeping between reads: finer timing, costs a whole core",
    )


def _fail(message: str) -> int:
    print(f"syshax benchmark: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.deployment:
        if args.target or any(getattr(args, f"target_{m}") for m in BENCHMARK_MODES):
            return _fail("--deployment and --target* are exclusive")
        if not args.control_plane:
            return _fail(
                f"--deployment needs a control plane: set {CONTROL_PLANE_ENV} or "
                "--control-plane URL, or benchmark a URL with --target"
            )

        control = ControlPlane(args.control_plane, args.token)
        try:
            found = control.resolve(args.deployment)
        except ControlPlaneError as exc:
            control.close()
            return _fail(str(exc))
        args.target, args.model = found.router_url, args.model or found.model
        args.mode = args.mode or "all"
        print(
            f"deployment {found.name}: model {found.model} through router {found.router_url}",
            file=sys.stderr,
        )
    try:
        mix = _mixed_scenario(args)
        scenario = (
            resolve_scenario(args.scenario, args.input_tokens, args.output_tokens)
            if mix is None
            else _mix_scenario(mix)
        )
        levels = (
            parse_concurrency(args.concurrency) if args.concurrency else scenario.concurrency_levels
        )
        per_mode = {mode: getattr(args, f"target_{mode}") for mode in BENCHMARK_MODES}
        targets = plan_targets(args.mode, args.target, per_mode)
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        slos = (
            class_slos(
                [c.slo_class for c in mix.classes],
                slo,
                args.batch_slo_ttft_ms,
                args.batch_slo_tpot_ms,
            )
            if mix is not None
            else None
        )
        rates = parse_rates(args.request_rate)
        check_attainment(args.slo_attainment)
        sweeping = len(rates) > 1 or args.find_max_goodput or args.chart is not None
        if sweeping:
            if mix is not None:
                raise ValueError(
                    f"a mixed scenario ({mix.name}) runs concurrency levels or one "
                    "--request-rate, not a goodput sweep; the mixed-traffic sweep is "
                    "scripts/bench/goodput_sweep.py --mixed (docs/benchmarks.md)"
                )
            _check_sweep(args, rates, slo)
        cap = (levels[0] if args.concurrency else None) if sweeping else levels[0]
        LoadSpec(cap, rates[0], args.burstiness, args.seed)
    except ValueError as exc:
        return _fail(str(exc))
    args.request_rate = rates[0]
    if args.iterations < 1:
        return _fail("--iterations must be at least 1")
    if args.sim_speed <= 0:
        return _fail("--sim-speed must be positive")
    if args.realtime:
        if args.busy_poll:
            return _fail("--realtime with --busy-poll would hold a core; choose one")
        problem = use_realtime_priority()
        if problem:
            print(f"syshax benchmark: {problem}; timing at ordinary priority", file=sys.stderr)
    sweeps: dict[str, GoodputSearch] = {}
    try:
        if sweeping:
            rows = run_async(_sweep(args, scenario, rates, cap, targets, slo, sweeps))
        else:
            rows = run_async(_benchmark(args, scenario, levels, targets, slo, mix, slos))
    except TargetUnavailable as exc:
        return _fail(f"{exc} (a target must be up before the run starts)")
    if args.deployment:
        try:
            for row in rows:
                if row.window:
                    row.resources = control.resources(found.node_id, *row.window)
        except ControlPlaneError as exc:
            print(f"syshax benchmark: resource use not read: {exc}", file=sys.stderr)
        finally:
            control.close()
    if mix is None:
        print(
            f"\nscenario {scenario.name}: {scenario.input_tokens} -> {scenario.output_tokens} "
            f"tokens, {args.iterations} requests per row\n"
        )
    else:
        print(f"\n{_describe_mix(mix)}, {args.iterations} requests per row\n")
    print(format_table(rows))
    classes = format_classes(rows)
    if classes:
        print(f"\nper SLO class ({format_class_slos(rows)}):\n" + classes)
    ratios = format_ratios(rows)
    if ratios:
        print("\n" + ratios)
    resources = format_resources(rows)
    if resources:
        print("\nnode resource use (agents' heartbeats):\n" + resources)
    errors = format_errors(rows)
    if errors:
        print("\nfailed requests:\n" + errors)
    if sweeps:
        print("\ngoodput at the SLOs:\n" + format_sweeps(sweeps))
        for baseline in ("gpu", "cpu"):
            line = ratio_line(sweeps, "hetero", baseline)
            if line:
                print(line)
    if args.chart is not None and sweeps:
        args.chart.write_text(sweep_svg(sweeps, f"scenario {scenario.name}"))
        print(f"\nwrote {args.chart}")
    if args.json:
        config = _config(args, scenario, levels, targets, slo)
        if mix is not None and slos is not None:
            config["scenario"] = mix.to_dict()
            config["class_slo_ms"] = {
                name: {"ttft": c.ttft_ms, "tpot": c.tpot_ms, "e2e": c.e2e_ms}
                for name, c in slos.items()
            }
        config["request_rates"] = list(rates) if sweeping else None
        config["slo_attainment"] = args.slo_attainment
        document = to_json(config, rows, samples=args.samples)
        if sweeps:
            document["sweeps"] = {mode: search.to_dict() for mode, search in sweeps.items()}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if any(row.summary.failed for row in rows) else 0


def _mixed_scenario(args: argparse.Namespace) -> MixedScenario | None:
    """The mixed scenario ``--scenario`` names, or None for a scenario of one shape."""
    mix = MIXED_SCENARIOS.get(args.scenario)
    if mix is None:
        if args.scenario not in SCENARIOS and args.scenario != "custom":
            known = ", ".join([*SCENARIOS, "custom", *MIXED_SCENARIOS])
            raise ValueError(f"unknown scenario {args.scenario!r} (known: {known})")
        if args.batch_slo_ttft_ms is not None or args.batch_slo_tpot_ms is not None:
            raise ValueError("--batch-slo-ttft-ms and --batch-slo-tpot-ms need a mixed scenario")
        return None
    if args.input_tokens is not None or args.output_tokens is not None:
        raise ValueError(
            f"the mixed scenario {mix.name} gives each class its own shape; "
            "--input-tokens and --output-tokens do not apply"
        )
    return mix


def _mix_scenario(mix: MixedScenario) -> Scenario:
    """A stand-in shape for a mixed run: its concurrency range spans the classes' ranges
    (chat-and-batch: 1-16); its token counts are the share-weighted means, for the table's
    header only (each request is sent at its own class's shape)."""
    shapes = [c.scenario for c in mix.classes]
    return Scenario(
        mix.name,
        max(1, round(sum(c.share * c.scenario.input_tokens for c in mix.classes))),
        max(1, round(sum(c.share * c.scenario.output_tokens for c in mix.classes))),
        min(s.concurrency_min for s in shapes),
        max(s.concurrency_max for s in shapes),
        mix.description,
    )


def _describe_mix(mix: MixedScenario) -> str:
    parts = [
        f"{c.slo_class} {100 * c.share:g}% (service_tier {c.service_tier}, "
        f"{c.scenario.input_tokens} -> {c.scenario.output_tokens} tokens)"
        for c in mix.classes
    ]
    return f"mixed scenario {mix.name}: " + ", ".join(parts)


def _specs(
    scenario: Scenario, mix: MixedScenario | None, count: int, seed: int, first_index: int = 0
) -> list[RequestSpec]:
    if mix is not None:
        return build_mixed_requests(count, mix, seed, first_index)
    return build_requests(count, scenario.input_tokens, scenario.output_tokens, seed, first_index)


_TIER_CLASSES = {tier: name for name, tier in SERVICE_TIERS.items()}


def request_classes(specs: Sequence[RequestSpec]) -> dict[int, str]:
    """Each request's SLO class, by its index, from the ``service_tier`` it carries."""
    return {
        spec.index: _TIER_CLASSES[spec.service_tier]
        for spec in specs
        if spec.service_tier is not None
    }


def _auth(args: argparse.Namespace, target: Target) -> dict[str, str]:
    """The key for ``target``: ``--api-key``; else, where the run forces the router's mode,
    its benchmark key (a plain key may not force one); else its API key."""
    forcing = os.environ.get(BENCHMARK_KEY_ENV) if target.forced else None
    key = args.api_key or forcing or os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _models(args: argparse.Namespace, targets: list[Target]) -> dict[str, str]:
    """Every target's model, asked before the first row, so a dead target stops the run at
    once instead of after an hour of other rows."""
    models: dict[str, str] = {}
    async with make_session() as session:
        for target in targets:
            if target.url not in models:
                auth = _auth(args, target)
                models[target.url] = args.model or await discover_model(session, target.url, auth)
    return models


def _client(
    args: argparse.Namespace,
    pool: ConnectionPool,
    target: Target,
    model: str,
) -> StreamClient:
    return StreamClient(
        pool,
        target.url,
        model,
        api=args.api,
        headers={**target.headers, **_auth(args, target)},
        timeout_s=args.timeout,
    )


async def _benchmark(
    args: argparse.Namespace,
    scenario: Scenario,
    levels: tuple[int, ...],
    targets: list[Target],
    slo: SLO,
    mix: MixedScenario | None = None,
    slos: dict[str, SLO] | None = None,
) -> list[Row]:
    rows: list[Row] = []
    models = await _models(args, targets)
    pool = ConnectionPool()
    try:
        for level in levels:
            # The same prompts for every mode at a level, so the modes compare like for like
            # (and, in a mixed scenario, the same classes in the same order).
            seed = args.seed * 1_000_003 + level
            specs = _specs(scenario, mix, args.iterations, seed)
            warmup_count = level if args.warmup is None else args.warmup
            warmup = _specs(scenario, mix, warmup_count, seed + 1, WARMUP_INDEX)
            by_index = request_classes(specs) if mix is not None else None
            for target in targets:
                client = _client(args, pool, target, models[target.url])
                load = LoadSpec(level, args.request_rate, args.burstiness, args.seed)
                bar = ProgressBar(
                    len(specs),
                    f"{target.mode:>6} c={level:<3}",
                    live=None if not args.no_progress else False,
                )
                began = time.time()
                result = await run_load(
                    client,
                    specs,
                    load,
                    warmup=warmup,
                    on_done=None if args.no_progress else bar.update,
                    busy_poll=args.busy_poll,
                )
                if not args.no_progress:
                    bar.close()
                # Simulated time: stretch each record once, so summary and samples agree.
                records = [record.scaled(args.sim_speed) for record in result.records]
                duration = result.duration_s * args.sim_speed
                classes = None
                if mix is None or by_index is None:
                    summary = summarize(records, duration, slo)
                else:
                    # Each request is judged against its own class's SLO, in its class's
                    # row and in the whole row's goodput.
                    tiers = {c.slo_class: c.service_tier for c in mix.classes}
                    classes = summarize_classes(records, by_index, tiers, duration, slos or {})
                    summary = combined_goodput(summarize(records, duration), classes)
                rows.append(
                    Row(
                        target.mode,
                        level,
                        target.url,
                        models[target.url],
                        summary,
                        records,
                        window=(began, time.time()),
                        classes=classes,
                        request_classes=by_index,
                    )
                )
    finally:
        pool.close()
    return rows


def _check_sweep(args: argparse.Namespace, rates: tuple[float, ...], slo: SLO) -> None:
    if any(math.isinf(rate) for rate in rates):
        raise ValueError("--request-rate: a goodput sweep needs finite rates, not inf")
    if slo.empty:
        raise ValueError(
            "a goodput sweep needs an SLO: --slo-ttft-ms, --slo-tpot-ms or --slo-e2e-ms"
        )
    if args.concurrency and len(parse_concurrency(args.concurrency)) > 1:
        raise ValueError(
            "--concurrency: a rate sweep takes at most one level (the cap on requests in "
            "flight); sweep either rates or concurrency levels"
        )


async def _sweep(
    args: argparse.Namespace,
    scenario: Scenario,
    rates: tuple[float, ...],
    cap: int | None,
    targets: list[Target],
    slo: SLO,
    sweeps: dict[str, GoodputSearch],
) -> list[Row]:
    """Every target through every rate (then the bisection), one row per (mode, rate)."""
    rows: list[Row] = []
    plan = SweepPlan(
        rates=rates,
        slo=slo,
        iterations=args.iterations,
        input_tokens=scenario.input_tokens,
        output_tokens=scenario.output_tokens,
        cap=cap,
        attainment=args.slo_attainment,
        bisections=DEFAULT_BISECTIONS if args.find_max_goodput else 0,
        warmup=args.warmup if args.warmup is not None else 1,
        seed=args.seed,
        burstiness=args.burstiness,
        sim_speed=args.sim_speed,
    )

    def progress(mode: str, rate: float, count: int) -> tuple[OnDone | None, Closer | None]:
        if args.no_progress:
            return None, None
        bar = ProgressBar(count, f"{mode:>6} r={rate:<5g}", live=None)
        return bar.update, bar.close

    models = await _models(args, targets)
    pool = ConnectionPool()
    try:
        for target in targets:
            client = _client(args, pool, target, models[target.url])
            search, target_rows = await sweep_target(
                client,
                target,
                models[target.url],
                plan,
                progress=progress,
                busy_poll=args.busy_poll,
            )
            sweeps[target.mode] = search
            rows += target_rows
    finally:
        pool.close()
    return rows


def _without_secrets(argv: list[str]) -> list[str]:
    shown = []
    hide_next = False
    for arg in argv:
        if hide_next:
            arg, hide_next = "***", False
        elif arg in _SECRET_FLAGS:
            hide_next = True
        elif arg.startswith(tuple(f"{flag}=" for flag in _SECRET_FLAGS)):
            arg = arg.split("=", 1)[0] + "=***"
        shown.append(arg)
    return shown


def _config(
    args: argparse.Namespace,
    scenario: Scenario,
    levels: tuple[int, ...],
    targets: list[Target],
    slo: SLO,
) -> dict[str, object]:
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": _without_secrets(sys.argv[1:]),
        "scenario": scenario.to_dict(),
        "concurrency": list(levels),
        "iterations": args.iterations,
        "warmup": args.warmup if args.warmup is not None else "one per concurrency slot",
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "seed": args.seed,
        "api": args.api,
        "targets": [target.to_dict() for target in targets],
        "slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms, "e2e": slo.e2e_ms},
        "sim_speed": args.sim_speed,
        "timing": "time.perf_counter per socket read; vLLM bench serve definitions",
        "clock_resolution_s": time.get_clock_info("perf_counter").resolution,
    }
