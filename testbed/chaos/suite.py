"""Run chaos scenarios on one stack and report them: a markdown table and a JSON document.
Used by scripts/bench/chaos.py and tests/chaos/test_chaos.py."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from testbed.chaos.scenarios import (
    SCENARIOS,
    Durations,
    ScenarioResult,
    baseline_deploy,
    run_scenario,
)
from testbed.chaos.stack import ROOT, StackConfig, chaos_stack

TARGETS = "0 lost, 0 run twice, 0 orphaned engines, 0 client errors, recovered"


def run_suite(
    durations: Durations,
    only: Iterable[str] = (),
    *,
    stack_config: StackConfig | None = None,
    workdir: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    names = list(only) or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="syshax-chaos-"))
    tree = tree_state()  # what the stack's snapshot of the tree is taken from
    began = time.monotonic()
    results: list[ScenarioResult] = []
    with chaos_stack(workdir, stack_config) as stack:
        progress(f"stack up in {time.monotonic() - began:.1f} s ({workdir})")
        baseline = baseline_deploy(stack, 1 if len(names) < 3 else 3)
        progress(f"fault-free redeploy until the router serves it: {baseline:.2f} s")
        for name in names:
            started = time.monotonic()
            result = run_scenario(stack, durations, name)
            result.details["scenario_seconds"] = round(time.monotonic() - started, 1)
            progress(f"{name}: {', '.join(result.missed) or 'targets met'} ({row(result)})")
            results.append(result)
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "tree": tree,
        "durations": asdict(durations),
        "stack": asdict(stack_config or StackConfig()),
        "baseline_redeploy_s": baseline,
        "total_seconds": round(time.monotonic() - began, 1),
        "targets": TARGETS,
        "scenarios": [r.as_dict() for r in results],
        "workdir": str(workdir),
    }


def row(result: ScenarioResult) -> str:
    errors = "-" if result.client_errors is None else str(result.client_errors)
    recovery = "never" if result.recovery_s is None else f"{result.recovery_s:.1f}"
    return f"lost {result.lost}, twice {result.run_twice}, errors {errors}, recovery {recovery}"


def render_table(report: dict[str, Any]) -> str:
    lines = [
        "| scenario | fault | lost | run twice | client errors | recovery (s) | process exits "
        "| target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["scenarios"]:
        errors = "-" if s["client_errors"] is None else str(s["client_errors"])
        recovery = "never" if s["recovery_s"] is None else f"{s['recovery_s']:.1f}"
        twice = str(s["run_twice"]) + (f" (+{s['orphans']} orphaned)" if s["orphans"] else "")
        target = "met" if not s["missed"] else "**missed**: " + ", ".join(s["missed"])
        lines.append(
            f"| {s['name']} | {s['fault']} | {s['lost']} | {twice} | {errors} | {recovery} "
            f"| {len(s['exits'])} | {target} |"
        )
    notes = [
        f"- {s['name']}: {note}"
        for s in report["scenarios"]
        for note in [*s["notes"], *(f"restarted: {e}" for e in s["exits"])]
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def render_breakdown(report: dict[str, Any]) -> str:
    """Recovery of each deploy by where its fault landed, and what each load saw."""
    triggers = ("requested", "stop-old-gpu", "start-gpu", "start-cpu")
    lines = [
        "| scenario | " + " | ".join(f"fault at {t}" for t in triggers) + " |",
        "|---|" + "---|" * len(triggers),
    ]
    loads = []
    for s in report["scenarios"]:
        deploys = s["details"].get("deploys")
        if deploys:
            cells = []
            for trigger in triggers:
                hits = [d for d in deploys if d["fault_at"] == trigger]
                cells.append(
                    ", ".join(
                        "never" if d["recovery_s"] is None else f"{d['recovery_s']:.1f} s"
                        for d in hits
                    )
                    or "-"
                )
            lines.append(f"| {s['name']} | " + " | ".join(cells) + " |")
        load = s["details"].get("load")
        if load:
            routes = ", ".join(f"{k} {v}" for k, v in sorted(load["routes"].items()))
            fallbacks = s["details"].get("router_fallbacks") or {}
            hidden = ", ".join(f"{k} {v:g}" for k, v in sorted(fallbacks.items())) or "none"
            loads.append(
                f"| {s['name']} | {load['requests']} | {load['ok']} | {load['errors']} "
                f"| {routes} | {hidden} |"
            )
    if loads:
        lines += [
            "",
            "| scenario | requests | whole | errors | routes | router fallbacks |",
            "|---|---|---|---|---|---|",
            *loads,
        ]
    return "\n".join(lines)


def tree_state() -> str:
    """The commit measured, and whether the working tree differed from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{commit}{' + uncommitted changes' if dirty else ''}"
