"""The chaos suite: crash and freeze the parts of syshax mid-deploy and under load, recover,
and measure what is lost, what runs twice, what clients see and how long recovery takes.

    .venv/bin/python scripts/bench/chaos.py [--quick] [--only NAME ...] [--json FILE]

Brings up a system of its own (a throwaway Redis and PostgreSQL on free ports, the control
plane's web, worker and beat, one agent with the process runtime, simulated engines, one
router) and runs every scenario on it, or those named by ``--only``. Prints a markdown table,
writes the full report as JSON, and exits 1 when a scenario misses a target (0 lost, 0 run
twice, 0 orphaned engines, 0 client errors, recovered before the deadline). ``--quick`` scales
the 30 s Redis pause and the 60 s control-plane outage (and the rest) down to seconds, as
tests/chaos runs it. The suite is testbed/chaos; what each scenario shows: docs/chaos.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from testbed.chaos.scenarios import SCENARIOS, Durations  # noqa: E402
from testbed.chaos.stack import StackConfig  # noqa: E402
from testbed.chaos.suite import render_breakdown, render_table, run_suite  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds instead of minutes (CI)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=sorted(SCENARIOS),
        metavar="NAME",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "var" / "chaos" / "chaos.json")
    parser.add_argument("--workdir", type=Path, help="keep the stack's files here")
    tune = parser.add_argument_group("durations (default: the full run, or --quick's)")
    tune.add_argument("--down", type=float, help="seconds a killed process stays down")
    tune.add_argument("--redis-pause", type=float, help="seconds Redis stays stopped")
    tune.add_argument("--control-plane-down", type=float, help="seconds of the outage")
    tune.add_argument("--deploys", type=int, help="deploys per deploy scenario")
    tune.add_argument("--clients", type=int, help="concurrent client streams")
    tune.add_argument("--recovery-deadline", type=float, help="seconds before 'lost'")
    engines = parser.add_argument_group("engines")
    engines.add_argument("--sim-speed", type=float, default=StackConfig.sim_speed)
    engines.add_argument(
        "--engine-start-delay",
        type=float,
        default=StackConfig.engine_start_delay_s,
        help="seconds of simulated model loading added to every engine start",
    )
    return parser.parse_args(argv)


def durations_from(args: argparse.Namespace) -> Durations:
    base = Durations.quick() if args.quick else Durations()
    overrides = {
        "down_s": args.down,
        "redis_pause_s": args.redis_pause,
        "control_plane_down_s": args.control_plane_down,
        "deploys": args.deploys,
        "clients": args.clients,
        "recovery_deadline_s": args.recovery_deadline,
    }
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def stop_on_signal(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through the stack's teardown: nothing is left running


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # A background job starts with SIGINT ignored; either signal must tear the stack down.
    signal.signal(signal.SIGINT, stop_on_signal)
    signal.signal(signal.SIGTERM, stop_on_signal)
    stack = StackConfig(sim_speed=args.sim_speed, engine_start_delay_s=args.engine_start_delay)
    report = run_suite(
        durations_from(args),
        args.only,
        stack_config=stack,
        workdir=args.workdir,
        progress=lambda line: print(line, flush=True),
    )
    print()
    print(render_table(report))
    print()
    print(render_breakdown(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nreport: {args.json} ({report['total_seconds']:.0f} s, tree {report['tree']})")
    return 1 if any(s["missed"] for s in report["scenarios"]) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
