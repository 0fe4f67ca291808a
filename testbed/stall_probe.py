"""Is the machine itself stalling? A process that asks to wake every few milliseconds and
writes down each wake-up that came late.

It runs under the real-time FIFO scheduler where it may (root): no process of ours at normal
priority can then keep it off a core. A late wake-up of such a process means the whole machine
stood still (the hypervisor gave its virtual CPUs to someone else, or the kernel held the
core), not that our processes were busy. Without that privilege it runs at normal priority and
says so; its lateness then also counts ordinary CPU contention.

    python -m testbed.stall_probe OUT.jsonl [--seconds S] [--tick-ms T] [--late-ms L]

Each line of OUT is ``{"at": wall-clock seconds, "late_ms": ms}``; the first line says the
scheduler it got. Benchmarks start it beside their load and read the file afterwards
(scripts/bench/fleet_load.py, through scripts/bench/stall_probe.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def realtime() -> str:
    """Ask for SCHED_FIFO at a middle priority; the scheduler got, in words."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except (AttributeError, PermissionError, OSError) as exc:
        return f"normal priority (no SCHED_FIFO: {exc.__class__.__name__})"
    return "SCHED_FIFO 50"


def probe(out: str, seconds: float, tick: float, late: float) -> None:
    scheduler = realtime()
    with open(out, "w", buffering=1) as f:
        f.write(json.dumps({"scheduler": scheduler, "tick_ms": tick * 1000}) + "\n")
        end = time.monotonic() + seconds
        while True:
            asked = time.monotonic()
            if asked >= end:
                return
            time.sleep(tick)
            overshoot = time.monotonic() - asked - tick
            if overshoot >= late:
                f.write(json.dumps({"at": time.time(), "late_ms": round(overshoot * 1000, 3)}))
                f.write("\n")


def read(path: str) -> tuple[str, list[tuple[float, float]]]:
    """The scheduler the probe got and its late wake-ups (wall time, ms)."""
    scheduler, stalls = "not started", []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "scheduler" in row:
                scheduler = row["scheduler"]
            else:
                stalls.append((float(row["at"]), float(row["late_ms"])))
    return scheduler, stalls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where to write the late wake-ups (JSON lines)")
    parser.add_argument("--seconds", type=float, default=3600.0, help="how long to run")
    parser.add_argument("--tick-ms", type=float, default=5.0, help="the sleep asked for")
    parser.add_argument("--late-ms", type=float, default=20.0, help="lateness worth a line")
    args = parser.parse_args()
    if not 0.1 <= args.tick_ms <= 1000:
        parser.error("--tick-ms must be between 0.1 and 1000")
    if args.late_ms <= 0:
        parser.error("--late-ms must be above 0")
    probe(args.out, args.seconds, args.tick_ms / 1000, args.late_ms / 1000)


if __name__ == "__main__":
    main()
