#!/usr/bin/env python3
"""Concurrent placement on PostgreSQL: N placed deployments deployed at once onto M nodes.

    .venv/bin/python scripts/bench/placement_load.py [--deployments 100] [--nodes 50] [--threads 16]
        [--postgres postgres://postgres@127.0.0.1:5432/postgres]

It creates a database of its own (``syshax_place_<random>``), migrates it, builds a fleet
(1-4 cards of 40 or 80 GiB per node, two NUMA nodes of 8 cores, racks r1-r5), then deploys
every deployment from ``--threads`` threads at once through the same service the API uses,
and checks what the placement promises: no card or core held twice, no port used twice on a
node, every refusal naming a known constraint. It prints the counts and exits 1 on a
violation. The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONSTRAINTS = {
    "node",
    "node_selector",
    "tensor_parallel_size",
    "min_device_memory_gb",
    "accelerator_kind",
    "ports",
    "cpu_cores",
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployments", type=int, default=100)
    p.add_argument("--nodes", type=int, default=50)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432/postgres")
    return p.parse_args()


def main() -> int:
    args = parse()
    import psycopg

    name = f"syshax_place_{secrets.token_hex(4)}"
    admin = psycopg.connect(args.postgres, autocommit=True)
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        os.environ["DATABASE_URL"] = args.postgres.rsplit("/", 1)[0] + f"/{name}"
        os.environ.setdefault("SYSHAX_ENV_FILE", "/nonexistent/syshax.env")
        os.environ.setdefault("SYSHAX_VAR_DIR", f"/tmp/{name}")
        os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings.local"
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        return run(args)
    finally:
        from django.db import connections

        connections.close_all()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def run(args: argparse.Namespace) -> int:
    from django.db import connections

    from controlplane.deployments import services
    from controlplane.deployments.models import AcceleratorClaim, Deployment
    from controlplane.deployments.placement import PlacementError
    from controlplane.inventory.cpulist import parse_cpu_list
    from testbed.factories import build_node, build_profile

    rng = random.Random(args.seed)
    for i in range(args.nodes):
        build_node(
            f"n{i:03d}",
            accelerators=rng.randint(1, 4),
            accel_gb=rng.choice((40, 80)),
            numa=2,
            cores_per_numa=8,
            status="online",
            labels={"rack": f"r{i % 5 + 1}"},
        )
    deployments = []
    for i in range(args.deployments):
        profile = build_profile(
            tensor_parallel_size=rng.choice((1, 1, 2)),
            enable_cpu_engine=rng.random() < 0.5,
            gpu_port=10000 + 2 * i,
            cpu_port=10001 + 2 * i,
        )
        constraints: dict[str, object] = {}
        if rng.random() < 0.3:
            constraints["node_selector"] = {"rack": f"r{rng.randint(1, 5)}"}
        if rng.random() < 0.3:
            constraints["min_device_memory_gb"] = 64.0
        if profile.enable_cpu_engine:
            constraints["cpu_cores"] = rng.choice((2, 4, 6))
            constraints["cpu_numa_local"] = rng.random() < 0.5
        try:
            deployments.append(
                services.create_deployment(
                    name=f"d{i:03d}", profile=profile, node=None, acting_user="load", **constraints
                )
            )
        except PlacementError as exc:  # already nowhere to go at creation: counts as a refusal
            print(f"create d{i:03d} refused: {exc.field}: {exc.message}")
    connections.close_all()

    refusals: list[tuple[str, str]] = []
    seconds: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(args.threads)

    def worker(chunk: list[Deployment]) -> None:
        barrier.wait()
        for deployment in chunk:
            began = time.perf_counter()
            try:
                services.request_deploy(deployment, acting_user="load")
            except PlacementError as exc:
                with lock:
                    refusals.append((exc.field, exc.message))
            with lock:
                seconds.append(time.perf_counter() - began)
        connections.close_all()

    began = time.perf_counter()
    threads = [
        threading.Thread(target=worker, args=(deployments[i :: args.threads],))
        for i in range(args.threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began

    violations: list[str] = []
    cards = list(AcceleratorClaim.objects.values_list("accelerator_id", flat=True))
    if len(cards) != len(set(cards)):
        violations.append("a card is held twice")
    cores: dict[int, Counter[int]] = defaultdict(Counter)
    ports: dict[int, Counter[int]] = defaultdict(Counter)
    placed = Deployment.objects.filter(state="deploying").select_related("profile")
    for deployment in placed:
        for cpu in parse_cpu_list(str(deployment.affinity_plan.get("cpuset", ""))):
            cores[deployment.node_id][cpu] += 1
        ports[deployment.node_id][deployment.profile.gpu_port] += 1
        if deployment.profile.enable_cpu_engine:
            ports[deployment.node_id][deployment.profile.cpu_port] += 1
        held = deployment.accelerator_claims.count()
        if held != deployment.profile.tensor_parallel_size:
            violations.append(f"{deployment.name} holds {held} cards")
    if any(n > 1 for counts in cores.values() for n in counts.values()):
        violations.append("a core is held twice")
    if any(n > 1 for counts in ports.values() for n in counts.values()):
        violations.append("a port is used twice on one node")
    unnamed = [r for r in refusals if r[0] not in CONSTRAINTS or not r[1]]
    if unnamed:
        violations.append(f"{len(unnamed)} refusal(s) name no known constraint: {unnamed[:3]}")

    print(
        f"{len(deployments)} deploys from {args.threads} threads onto {args.nodes} nodes "
        f"({sum(1 for _ in AcceleratorClaim.objects.all())} cards claimed) in {wall:.2f} s"
    )
    print(f"placed: {placed.count()}, refused: {len(refusals)}")
    for field, count in Counter(f for f, _ in refusals).most_common():
        example = next(m for f, m in refusals if f == field)
        print(f"  {count:3d} x {field}: e.g. {example}")
    if seconds:
        ordered = sorted(seconds)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        median = statistics.median(seconds)
        print(f"deploy call: median {median * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    print(
        "cards held twice: 0, cores held twice: 0, ports used twice: 0"
        if not violations
        else "VIOLATIONS: " + "; ".join(violations)
    )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
