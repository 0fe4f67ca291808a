#!/usr/bin/env python3
"""Many producers and consumers on one embedded-broker folder: count what is lost, duplicated
or corrupt.

    .venv/bin/python scripts/bench/broker_stress.py [--messages 10000] [--producers 4]
        [--consumers 3] [--transports syshaxfs,filesystem]

Each producer process publishes its share of numbered messages (a body with a checksum), and
each consumer process takes messages until the queue stays empty, writing what it got to its own
file. The figures for every transport are printed side by side: kombu's own ``filesystem://``
beside ``syshaxfs://`` (controlplane/core/broker.py). The harness is testbed/broker_stress.py;
tests/broker runs the same with assertions.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testbed.broker_stress import run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--transports", default="syshaxfs,filesystem")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    rows = [
        run(t.strip(), args.messages, args.producers, args.consumers)
        for t in args.transports.split(",")
    ]
    print(
        f"{args.messages} messages, {args.producers} producers, {args.consumers} consumers\n"
        f"{'transport':<12}{'received':>10}{'lost':>7}{'dup':>6}{'corrupt':>9}{'msg/s':>9}"
    )
    for row in rows:
        print(
            f"{row.transport:<12}{row.received:>10}{row.lost:>7}{row.duplicated:>6}"
            f"{row.corrupt:>9}{row.rate:>9.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"rate": r.rate} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
