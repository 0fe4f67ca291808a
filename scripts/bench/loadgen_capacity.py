#!/usr/bin/env python3
"""Can one core of load generator time 256 concurrent streams to within 1 ms?

Pins this process (the generator) to one core and the simulated engine to another, raises
the generator to real-time priority where the OS allows (``--no-realtime`` to compare), runs
``--streams`` concurrent streams, and compares each chunk's arrival with the engine's own
times: its token time (which includes the engine's own sending) and, where the engine reports
it, the moment it wrote the chunk to its socket (which leaves only the kernel and the
generator). The generator's added timing error must stay under 1 ms at p99.

    .venv/bin/python scripts/bench/loadgen_capacity.py --streams 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from loadgen.checks import capacity_report, measure
from loadgen.runner import run_async, use_realtime_priority
from loadgen.simproc import DEFAULT_MODEL, running_sim
from loadgen.stats import distribution

LIMIT_MS = 1.0


async def _timer_jitter(seconds: float) -> list[float]:
    """How late a 1 ms sleep wakes on this core: the machine's own scheduling noise."""
    lateness = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        lateness.append(time.perf_counter() - before - 0.001)
    return lateness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100-80gb")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="requests per stream")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--generator-cpu", type=int, default=0)
    parser.add_argument("--engine-cpu", type=int, default=1)
    parser.add_argument(
        "--no-realtime",
        action="store_true",
        help="leave the generator at ordinary priority (its stamps then wait for the scheduler)",
    )
    parser.add_argument(
        "--busy-poll", action="store_true", help="spin between reads (only without realtime)"
    )
    args = parser.parse_args()
    cores = os.sched_getaffinity(0)
    one_core = args.generator_cpu in cores and args.engine_cpu in cores
    if one_core:
        os.sched_setaffinity(0, {args.generator_cpu})
    priority = "ordinary priority"
    if not args.no_realtime:
        if args.busy_poll:
            parser.error("--busy-poll at real-time priority would hold the core; add --no-realtime")
        problem = use_realtime_priority()
        priority = problem or "SCHED_FIFO (the engine at ordinary priority)"
    print(
        f"generator on cpu {sorted(os.sched_getaffinity(0))} at {priority}, engine on cpu "
        f"{args.engine_cpu if one_core else 'any'}; device {args.device}, speed {args.speed}"
    )
    with running_sim(
        args.device,
        args.model,
        speed=args.speed,
        cpus={args.engine_cpu} if one_core else None,
        extra_args=["--max-num-seqs", str(max(256, args.streams))],
    ) as url:
        measured = run_async(
            measure(
                url,
                requests=args.streams * args.rounds,
                concurrency=args.streams,
                input_tokens=args.input_tokens,
                output_tokens=args.output_tokens,
                busy_poll=args.busy_poll,
            )
        )
    report = capacity_report(measured, args.streams)
    for line in report.lines():
        print(line)
    # Side by side: the same core's timer jitter, so a tail can be told from the machine's.
    jitter = distribution(run_async(_timer_jitter(3.0)))
    assert jitter.median is not None and jitter.p99 is not None
    print(
        f"baseline, a 1 ms sleep on the generator's core wakes late by: median "
        f"{jitter.median:.3f} ms, p99 {jitter.p99:.3f} ms; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    added = report.since_emitted or report.since_token
    assert added.p99 is not None
    ok = report.failed == 0 and added.p99 < LIMIT_MS
    verdict = "PASS" if ok else "FAIL"
    print(f"added timing error p99 {added.p99:.3f} ms (limit {LIMIT_MS} ms): {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
