"""Time the heartbeat batch's table parameter: one JSON document against an array a column.

    .venv/bin/python scripts/bench/heartbeat_batch_timing.py [--heartbeats 100] [--runs 30]
        [--postgres postgresql://postgres@127.0.0.1:5432/postgres]

The machine gateway writes a batch of heartbeats as three statements joined to a table of the
batch's rows (``controlplane.inventory.services._rows``). On PostgreSQL that table was one
array parameter a column (``unnest``); it is now one JSON document (``jsonb_to_recordset``).
``arrays`` below is the earlier form, kept here as the reference. Both run through Django's
own cursor (psycopg 3 with client-side binding, as the control plane runs), into temporary
tables shaped as the heartbeat rows and the cards' readings, with a batch of heartbeats of
8 cards each as the simulated agents send them.

It prints, for the batch's two row tables (the heartbeat rows, the cards' readings), the
median CPU milliseconds of this process (the gateway's, under its one lock) and the median
wall milliseconds of each form, and their ratios
(docs/decisions/0031-batch-rows-as-json.md). It writes nothing outside
its temporary tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HEARTBEAT = ["BIGINT", "DOUBLE PRECISION", "BIGINT", "BIGINT", "JSONB"]
READINGS = ["BIGINT", "TEXT", "DOUBLE PRECISION", "BIGINT", "DOUBLE PRECISION"]


def arrays(types: Sequence[str], rows: Sequence[Sequence[Any]]) -> tuple[str, list[Any]]:
    """The earlier form: one array parameter a column, ``unnest`` joins them into rows."""
    names = ", ".join(f"column{i}" for i in range(1, len(types) + 1))
    # An array of jsonb was sent as text, each element cast by the statement.
    sent = ["TEXT" if t == "JSONB" else t for t in types]
    cast = ", ".join(f"CAST(%s AS {t}[])" for t in sent)
    columns = [list(column) for column in zip(*rows, strict=True)]
    columns = [
        [json.dumps(v) for v in column] if t == "JSONB" else column
        for t, column in zip(types, columns, strict=True)
    ]
    return f"unnest({cast}) AS r({names})", columns


def batch(
    heartbeats: int, rng: random.Random
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """A batch's heartbeat rows and card readings, as the simulated agents report them."""
    beats, readings = [], []
    for node in range(1, heartbeats + 1):
        cards = [
            {
                "uuid": f"GPU-{node:08x}-{i:04x}-sim",
                "utilization_percent": round(rng.uniform(0, 100), 1),
                "memory_used_bytes": rng.randrange(80 * 1024**3),
                "temperature_c": round(rng.uniform(30, 80), 1),
                "power_watts": round(rng.uniform(50, 400), 1),
            }
            for i in range(8)
        ]
        total = 512 * 1024**3
        beats.append((node, rng.uniform(1, 60), int(total * rng.uniform(0.1, 0.6)), total, cards))
        readings += [
            (node, c["uuid"], c["utilization_percent"], c["memory_used_bytes"], c["temperature_c"])
            for c in cards
        ]
    return beats, readings


def timed(run: Callable[[], None], runs: int) -> tuple[float, float]:
    cpu, wall = [], []
    for _ in range(runs):
        c, w = time.process_time(), time.perf_counter()
        run()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu) * 1000, statistics.median(wall) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heartbeats", type=int, default=100, help="heartbeats a batch (default 100)")
    p.add_argument("--runs", type=int, default=30, help="batches timed each way (default 30)")
    p.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = p.parse_args()
    if not 1 <= args.heartbeats <= 5000 or not 1 <= args.runs <= 1000:
        p.error("--heartbeats must be 1-5000 and --runs 1-1000")
    os.environ["DATABASE_URL"] = args.postgres
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    import django

    django.setup()
    from django.db import connection, transaction

    from controlplane.inventory.services import _rows

    beats, readings = batch(args.heartbeats, random.Random(7))
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMP TABLE beat (node BIGINT, cpu DOUBLE PRECISION, used BIGINT,"
            " total BIGINT, cards JSONB)"
        )
        cursor.execute(
            "CREATE TEMP TABLE card (node BIGINT, uuid TEXT, util DOUBLE PRECISION,"
            " used BIGINT, temp DOUBLE PRECISION, PRIMARY KEY (node, uuid))"
        )
        source, params = _rows(READINGS, readings)
        cursor.execute(
            f"INSERT INTO card SELECT r.column1, r.column2, 0, 0, NULL FROM {source}", params
        )

    def insert(form: Callable[..., tuple[str, list[Any]]]) -> Callable[[], None]:
        value = "CAST(r.column5 AS jsonb)" if form is arrays else "r.column5"
        sql = f"INSERT INTO beat SELECT r.column1, r.column2, r.column3, r.column4, {value}"

        def run() -> None:
            source, params = form(HEARTBEAT, beats)  # building the parameters counts too
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"{sql} FROM {source}", params)

        return run

    def update(form: Callable[..., tuple[str, list[Any]]]) -> Callable[[], None]:
        def run() -> None:
            source, params = form(READINGS, readings)
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE card SET util = r.column3, used = r.column4, temp = r.column5"
                    f" FROM {source} WHERE node = r.column1 AND uuid = r.column2",
                    params,
                )

        return run

    print(
        f"{args.heartbeats} heartbeats a batch ({len(readings)} card readings),"
        f" median of {args.runs}"
    )
    print("| rows | arrays: CPU / wall ms | JSON: CPU / wall ms | CPU ratio | wall ratio |")
    print("|---|---|---|---|---|")
    for name, make in (("heartbeat rows", insert), ("card readings", update)):
        # Alternate the two forms, so both meet the same noise.
        old_cpu, old_wall, new_cpu, new_wall = [], [], [], []
        for _ in range(3):
            c, w = timed(make(arrays), max(1, args.runs // 3))
            old_cpu.append(c)
            old_wall.append(w)
            c, w = timed(make(_rows), max(1, args.runs // 3))
            new_cpu.append(c)
            new_wall.append(w)
        oc, ow = statistics.median(old_cpu), statistics.median(old_wall)
        nc, nw = statistics.median(new_cpu), statistics.median(new_wall)
        print(
            f"| {name} | {oc:.2f} / {ow:.2f} | {nc:.2f} / {nw:.2f}"
            f" | {nc / oc:.2f}x | {nw / ow:.2f}x |"
        )
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM beat")
        stored = cursor.fetchone()[0]
    expected = 6 * max(1, args.runs // 3) * args.heartbeats
    if stored != expected:
        print(f"stored {stored} heartbeat rows, expected {expected}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
