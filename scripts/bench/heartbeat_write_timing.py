#!/usr/bin/env python3
"""Time the gateway's heartbeat batch write, before and after it became one statement.

    .venv/bin/python scripts/bench/heartbeat_write_timing.py [--nodes 5000] [--heartbeats 30]
        [--runs 60] [--postgres postgresql://postgres@127.0.0.1:5432/postgres]

Two databases are built the same way (migrated, then ``--nodes`` nodes of 8 cards each):

- **before**: the tables as they were (the default fill factor, and the heartbeats' own index
  on ``node_id`` beside ``heartbeat_node_time_idx``), written as the batch was: three
  statements in a transaction (as the control plane still writes it on SQLite);
- **after**: the tables as migration ``inventory.0003`` leaves them, written by
  ``record_steady_heartbeats`` (one statement).

Every node's rows are first written twice on both sides, so both tables are in their steady
state (rows rewritten, not freshly loaded). Then batches of ``--heartbeats`` random nodes'
heartbeats go to each side in turn, ten at a time, and it prints per batch the median CPU of
this process (the gateway's, under its lock), the wall time and the WAL written, and the
database backend's mean CPU (the kernel counts it in 10 ms ticks), with the ratios; and the
share of node and card updates each side made without touching an index (HOT). Both
databases are dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CARDS = 8
BLOCK = 10  # batches in a row on one side before the other's turn


def three_statements(reports: Sequence[tuple[int, dict[str, Any]]]) -> dict[int, tuple[str, str]]:
    """The batch as it was written before: three statements in a transaction."""
    from django.db import connection
    from django.utils import timezone

    from controlplane.inventory.services import _record_steady_transaction

    return _record_steady_transaction(
        connection.ops.adapt_datetimefield_value(timezone.now()), reports
    )


def build(url: str, nodes: int, *, before: bool) -> None:
    """Migrate the database at ``url`` and load its nodes, in a process of its own."""
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": LOCAL}
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"], env=env, check=True)
    code = f"""
import django; django.setup()
from django.db import connection
from django.utils import timezone
from controlplane.inventory.models import Accelerator, Node
now = timezone.now()
Node.objects.bulk_create(
    [Node(name=f"n{{i}}", address="10.0.0.1", status="online", last_heartbeat_at=now)
     for i in range({nodes})], batch_size=1000)
Accelerator.objects.bulk_create(
    [Accelerator(node_id=n, kind="gpu", index=i, uuid=f"GPU-{{n}}-{{i}}",
                 memory_total_bytes=80 * 2**30)
     for n in Node.objects.values_list("pk", flat=True) for i in range({CARDS})],
    batch_size=5000)
if {before}:
    with connection.cursor() as c:
        for table in ("inventory_node", "inventory_accelerator"):
            c.execute(f"ALTER TABLE {{table}} RESET (fillfactor)")
            c.execute(f"VACUUM FULL {{table}}")
        c.execute("CREATE INDEX inventory_heartbeat_node_id ON inventory_heartbeat (node_id)")
"""
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True)


LOCAL = "controlplane.settings.local"


def batch(rng: random.Random, node_ids: list[int], size: int) -> list[tuple[int, dict[str, Any]]]:
    """Validated heartbeats of ``size`` distinct nodes, as the gateway's reader makes them."""
    return [
        (
            node,
            {
                "cpu_percent": round(rng.uniform(1, 60), 1),
                "memory_used_bytes": rng.randrange(64 * 2**30),
                "memory_total_bytes": 512 * 2**30,
                "inventory_hash": "",
                "accelerators": [
                    {
                        "uuid": f"GPU-{node}-{i}",
                        "utilization_percent": round(rng.uniform(0, 100), 1),
                        "memory_used_bytes": rng.randrange(80 * 2**30),
                        "temperature_c": round(rng.uniform(30, 80), 1),
                    }
                    for i in range(CARDS)
                ],
            },
        )
        for node in rng.sample(node_ids, size)
    ]


class Side:
    """One database, its writer and what one batch cost it."""

    def __init__(self, alias: str, write: Callable[..., dict[int, tuple[str, str]]]) -> None:
        from django.db import connections

        self.alias, self.write, self.conn = alias, write, connections[alias]
        self.cpu: list[float] = []
        self.backend: list[float] = []
        self.wall: list[float] = []
        self.wal: list[float] = []
        self.conn.ensure_connection()
        self.pid = self.scalar("SELECT pg_backend_pid()")
        self.node_ids = [int(n) for n in self.column("SELECT id FROM inventory_node ORDER BY id")]

    def scalar(self, sql: str) -> Any:
        with self.conn.cursor() as c:
            c.execute(sql)
            return c.fetchone()[0]

    def column(self, sql: str) -> list[Any]:
        with self.conn.cursor() as c:
            c.execute(sql)
            return [row[0] for row in c.fetchall()]

    def backend_cpu(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run(self, reports: list[tuple[int, dict[str, Any]]], measure: bool) -> None:
        from django.db import connections

        connections["default"] = self.conn  # the services write through the default alias
        lsn = self.scalar("SELECT pg_current_wal_insert_lsn()")
        backend, cpu, wall = self.backend_cpu(), time.process_time(), time.perf_counter()
        seen = self.write(reports)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        backend = self.backend_cpu() - backend
        wal = self.scalar(f"SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '{lsn}')")
        if len(seen) != len(reports):
            raise SystemExit(f"{self.alias}: {len(seen)} of {len(reports)} heartbeats recorded")
        if measure:
            self.cpu.append(cpu * 1000)
            self.backend.append(backend * 1000)
            self.wall.append(wall * 1000)
            self.wal.append(float(wal) / 1024)

    def updates(self) -> dict[str, tuple[int, int]]:
        """Each table's updates and HOT updates so far, this session's own included: its
        pending counters are flushed first (PostgreSQL 15 keeps them in the backend for up
        to a second, so a reset or a read right after the writes misses some)."""
        with self.conn.cursor() as c:
            c.execute("SELECT pg_stat_force_next_flush()")
        with self.conn.cursor() as c:  # flushed once the session went idle after the last
            c.execute("SELECT pg_stat_clear_snapshot()")
            c.execute(
                "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                " WHERE relname IN ('inventory_node', 'inventory_accelerator')"
            )
            return {name: (int(upd), int(hot)) for name, upd, hot in c.fetchall()}

    def hot(self, since: dict[str, tuple[int, int]]) -> str:
        now = self.updates()
        shares = []
        for table in ("inventory_node", "inventory_accelerator"):
            updated = now[table][0] - since[table][0]
            hot = now[table][1] - since[table][1]
            shares.append(f"{100 * hot / max(updated, 1):.0f} %")
        return " / ".join(shares)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--heartbeats", type=int, default=30, help="heartbeats a batch (default 30)")
    p.add_argument("--runs", type=int, default=60, help="batches timed a side (default 60)")
    p.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = p.parse_args()
    if not 10 <= args.nodes <= 100_000:
        p.error(f"--nodes must be 10-100000, not {args.nodes}")
    if not 1 <= args.heartbeats <= min(args.nodes, 5000):
        p.error(f"--heartbeats must be 1-{min(args.nodes, 5000)}, not {args.heartbeats}")
    if not BLOCK <= args.runs <= 1000:
        p.error(f"--runs must be {BLOCK}-1000, not {args.runs}")
    import psycopg

    server = args.postgres.rsplit("/", 1)[0]
    names = {side: f"syshax_hbwrite_{secrets.token_hex(4)}_{side}" for side in ("before", "after")}
    admin = psycopg.connect(args.postgres, autocommit=True)
    for name in names.values():
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        for side, name in names.items():
            build(f"{server}/{name}", args.nodes, before=side == "before")
        return compare(args, {side: f"{server}/{name}" for side, name in names.items()})
    finally:
        from django.db import connections

        connections.close_all()
        for name in names.values():
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def compare(args: argparse.Namespace, urls: dict[str, str]) -> int:
    os.environ["DATABASE_URL"] = urls["after"]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", LOCAL)
    import django
    from django.conf import settings

    django.setup()
    for alias, url in urls.items():
        settings.DATABASES[alias] = {**settings.DATABASES["default"], "NAME": url.rsplit("/")[-1]}
    from controlplane.inventory.services import record_steady_heartbeats

    sides = [Side("before", three_statements), Side("after", record_steady_heartbeats)]
    rng = random.Random(7)
    node_ids = sides[0].node_ids
    if node_ids != sides[1].node_ids:
        raise SystemExit("the two databases hold different nodes")
    # Every node's rows written twice on each side: the steady state, not a fresh load.
    order = [n for _ in range(2) for n in rng.sample(node_ids, len(node_ids))]
    for start in range(0, len(order), 100):
        reports = batch(rng, order[start : start + 100], min(100, len(order) - start))
        for side in sides:
            side.run(reports, measure=False)
    since = {side.alias: side.updates() for side in sides}
    for _ in range(args.runs // BLOCK):
        for side in sides:
            for _ in range(BLOCK):
                side.run(batch(rng, node_ids, args.heartbeats), measure=True)

    print(
        f"{args.heartbeats} heartbeats a batch of {CARDS} cards each, {args.nodes} nodes,"
        f" median of {len(sides[0].wall)} batches a side, alternating {BLOCK} at a time"
    )
    print(
        "| side | CPU ms (this process) | backend CPU ms (mean) | wall ms | WAL KiB"
        " | HOT node / card |"
    )
    print("|---|---|---|---|---|---|")
    med, mean = statistics.median, statistics.fmean
    for side in sides:
        print(
            f"| {side.alias} | {med(side.cpu):.2f} | {mean(side.backend):.2f}"
            f" | {med(side.wall):.2f}"
            f" | {med(side.wal):.1f} | {side.hot(since[side.alias])} |"
        )
    old, new = sides
    print(
        f"| after / before | {med(new.cpu) / med(old.cpu):.2f}x"
        f" | {mean(new.backend) / max(mean(old.backend), 1e-9):.2f}x"
        f" | {med(new.wall) / med(old.wall):.2f}x | {med(new.wal) / med(old.wal):.2f}x | |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
