#!/usr/bin/env python3
"""Does the load generator measure what the engine did?

Starts a simulated engine, runs the generator against it, and compares every request's TTFT
and TPOT with the engine's own record (``GET /sim/requests``): its modelled token times and,
when it records them, the moments it wrote each chunk to its socket. They must agree within
1 ms or 5 %, whichever is larger. Prints the medians side by side; exits 1 on any
disagreement with the socket writes (or the token times, when the engine has no writes).

    .venv/bin/python scripts/bench/loadgen_accuracy.py --requests 64 --concurrency 8
"""

from __future__ import annotations

import argparse
import sys

from loadgen.checks import accuracy_report, engine_reports_emission, measure
from loadgen.runner import run_async
from loadgen.simproc import DEFAULT_MODEL, running_sim


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100-80gb")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"device {args.device}, model {args.model}, speed {args.speed}: {args.requests} requests "
        f"at concurrency {args.concurrency}, {args.input_tokens} -> {args.output_tokens} tokens"
    )
    with running_sim(args.device, args.model, speed=args.speed, seed=args.seed) as url:
        measured = run_async(
            measure(
                url,
                requests=args.requests,
                concurrency=args.concurrency,
                input_tokens=args.input_tokens,
                output_tokens=args.output_tokens,
                seed=args.seed,
                warmup=args.concurrency,
            )
        )
    # The verdict uses the engine's socket writes when it records them: its modelled token
    # times also hold its own lateness in sending, which no client can observe.
    kinds = ["token", "emitted"] if engine_reports_emission(measured) else ["token"]
    reports = [accuracy_report(measured, since) for since in kinds]
    for report in reports:
        for line in report.lines():
            print(line)
        for agreement in report.disagreeing[:5]:
            print(f"    disagrees: {agreement}")
    verdict = reports[-1]
    print(f"verdict against the engine's {verdict.since} times: {'PASS' if verdict.ok else 'FAIL'}")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
