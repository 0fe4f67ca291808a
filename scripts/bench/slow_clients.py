#!/usr/bin/env python3
"""Slow clients against ``syshax web``: how long ``/api/v1/health`` takes while they hold on.

    .venv/bin/python scripts/bench/slow_clients.py [--slow-bodies 40] [--slow-heads 40]
        [--seconds 20] [--read-timeout 10]
        [--worker-classes gthread,controlplane.webworker.BufferedRequestWorker]

For each worker class it starts ``syshax web`` as the stack does (2 workers x 4 threads, on
the embedded SQLite in a fresh directory) on a free loopback port. Then it opens the slow
clients, on 127.0.0.1 only. A slow body sends a whole head announcing a 1000 byte form body
(to the admin login, with a well-formed CSRF cookie, so Django reads that body) and then one
byte of it a second. A slow head sends a request line and then one byte of a header a second.
Each one the server closes is opened again at once, as an attacker would. Meanwhile a client
asks for ``/api/v1/health`` on a new connection, one request after another (each waits at
most 10 s), and the figures for every worker class are printed side by side: the health
latency (median, 90th percentile, worst), the probes left unanswered, and how long the slow
connections were held. Everything stops after ``--seconds``. The clients and the server are
testbed/slow_clients.py; tests/controlplane/webworker/test_web_slow_clients.py runs them with
assertions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testbed.slow_clients import attack, report, serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow-bodies", type=int, default=40)
    parser.add_argument("--slow-heads", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--read-timeout", type=float, default=10.0)
    parser.add_argument(
        "--worker-classes", default="gthread,controlplane.webworker.BufferedRequestWorker"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="syshax-slow-") as scratch:
        for worker_class in args.worker_classes.split(","):
            with serving(worker_class, args.read_timeout, Path(scratch)) as port:
                figures = attack(
                    port,
                    slow_bodies=args.slow_bodies,
                    slow_heads=args.slow_heads,
                    seconds=args.seconds,
                )
            print(report(worker_class, figures), flush=True)


if __name__ == "__main__":
    main()
