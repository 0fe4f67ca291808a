#!/usr/bin/env python3
"""What sharing the tenants' limits through Redis costs, and how exactly it holds them
(docs/router.md, "Shared limits"; decision record 64).

    .venv/bin/python scripts/bench/shared_limits.py [--redis-url URL] [--admissions 20000]
        [--routers 3] [--workers 2] [--rpm 600] [--rate 30] [--seconds 60] [--json FILE]

(a) **Added latency per admission.** In one process, the same tenant table admits
``--admissions`` requests on local buckets and on the shared buckets in Redis, in
alternating blocks of 500, each admission timed on its own (``Tenants.admit_shared``, the
call a request makes; its TPM settlement included, as a request sends it). Prints p50 and
p99 of both and the difference.

(b) **RPM held across routers.** Starts one fast simulated GPU engine (``syshax sim``,
``--speed 50``) and ``--routers`` standalone routers (``syshax router --workers N``, every
one given ``--shared-limits-url``) in front of it, with a tenant limited to ``--rpm``. The
client drains the tenant's burst, then offers ``--rate`` requests a second (open loop,
round-robin over the routers' ports, each request a fresh connection so the workers share
the load) for ``--seconds``, and prints the admitted requests a minute, their ratio to
``--rpm``, and how many times any router fell back to local limits (from their logs).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.tenants import TenantRecord  # noqa: E402
from router.client.shared_limits import PREFIX, SharedLimits  # noqa: E402
from router.client.tenants import Tenants  # noqa: E402
from router.metrics import RouterMetrics, SharedLimitsMetrics  # noqa: E402

MODEL = "m"
KEY = "sk-shx-shared-limits-bench"
FALLBACK_LINE = "holding each tenant's limits locally"


# -- (a) the added latency per admission ------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def admission_latency(url: str, admissions: int, block: int = 500) -> dict[str, float]:
    """Microseconds per admission (and its settlement) on local and on shared buckets."""
    record = TenantRecord(f"bench-{uuid.uuid4().hex[:8]}", rpm_limit=10**9, tpm_limit=10**12)
    local = Tenants(None, (), RouterMetrics())
    metrics = RouterMetrics()
    prefix = f"{PREFIX}:bench:{uuid.uuid4().hex[:8]}"
    # A bound no answer reaches, so every admission is measured on Redis (on a loaded host
    # the 5 ms default would send some to the local buckets: that is the fallback's test).
    shared_limits = SharedLimits(
        url, SharedLimitsMetrics(metrics.registry), timeout=1.0, prefix=prefix
    )
    shared = Tenants(None, (), metrics, shared=shared_limits)
    for tenants in (local, shared):
        tenants.set_records([record])
    await shared_limits.start()
    timings: dict[str, list[float]] = {"local": [], "shared": []}
    clock = time.perf_counter_ns
    for _ in range(max(1, admissions // block)):
        for label, tenants in (("local", local), ("shared", shared)):
            for _ in range(block):
                started = clock()
                admission = await tenants.admit_shared(record, MODEL, 300)
                tenants.settle(admission, 100, 100, ok=True)
                timings[label].append((clock() - started) / 1000.0)
            await asyncio.sleep(0)  # let the settlements go out between blocks
    await asyncio.sleep(0.1)
    fallbacks = metrics.registry.get_sample_value("syshax_router_limits_fallbacks_total") or 0.0
    await shared_limits.redis.delete(
        *[key async for key in shared_limits.redis.scan_iter(f"{prefix}:*")] or ["-"]
    )
    await shared_limits.close()
    row = {
        f"{label}_{name}_us": round(percentile(values, q), 1)
        for label, values in timings.items()
        for name, q in (("p50", 0.5), ("p99", 0.99))
    }
    row["added_p50_us"] = round(row["shared_p50_us"] - row["local_p50_us"], 1)
    row["added_p99_us"] = round(row["shared_p99_us"] - row["local_p99_us"], 1)
    row["fallbacks"] = fallbacks
    return row


# -- (b) RPM across routers -------------------------------------------------------------------


@dataclass
class Child:
    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def start(args: list[str], workdir: Path, name: str) -> Child:
    ready = workdir / f"{name}.port"
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the child
    popen = subprocess.Popen(
        [sys.executable, "-m", "syshax.cli", *args, "--port", "0", "--ready-file", str(ready)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().strip()):
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start; see {log_path}")
        time.sleep(0.05)
    return Child(popen, f"http://127.0.0.1:{ready.read_text().strip()}", log_path)


def start_routers(args: argparse.Namespace, workdir: Path, gpu: Child) -> list[Child]:
    name = f"bench-{uuid.uuid4().hex[:8]}"  # a tenant no Redis bucket remembers
    tenants = workdir / "tenants.json"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    tenants.write_text(
        json.dumps({"tenants": [{"name": name, "keys": [digest], "rpm_limit": args.rpm}]})
    )
    return [
        start(
            [
                "router",
                *("--gpu-url", gpu.url, "--model", MODEL, "--mode", "gpu-only"),
                *("--tenants-file", str(tenants), "--workers", str(args.workers)),
                *("--shared-limits-url", args.redis_url, "--log-level", "WARNING"),
                *(("--shared-limits-timeout", str(args.timeout)) if args.timeout else ()),
            ],
            workdir,
            f"router{index}",
        )
        for index in range(args.routers)
    ]


async def offer(urls: list[str], rate: float, seconds: float) -> tuple[int, int, int]:
    """An open loop of ``rate`` requests a second for ``seconds``, round-robin over ``urls``:
    (admitted, refused, other answers)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEY}"}
    counts = {"ok": 0, "refused": 0, "other": 0}
    limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection each: any worker
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one(url: str) -> None:
            try:
                status = (await client.post(url, json=body, headers=headers)).status_code
            except httpx.HTTPError:
                status = 0
            counts["ok" if status == 200 else "refused" if status == 429 else "other"] += 1

        tasks = []
        started = time.monotonic()
        for index in range(int(rate * seconds)):
            delay = started + index / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            url = urls[index % len(urls)] + "/v1/chat/completions"
            tasks.append(asyncio.create_task(one(url)))
        await asyncio.gather(*tasks)
    return counts["ok"], counts["refused"], counts["other"]


async def drain(urls: list[str]) -> int:
    """Send until the tenant is refused: its burst spent, the steady state begins."""
    spent = 0
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            }
            url = urls[spent % len(urls)] + "/v1/chat/completions"
            answer = await client.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
            if answer.status_code == 429:
                return spent
            spent += 1


def rpm_across_routers(args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="shared-limits-") as tmp:
        workdir = Path(tmp)
        (workdir / "shm").mkdir()
        sim = [
            "sim",
            *("--device", "h100-80gb", "--model", "deepseek-r1-distill-qwen-32b"),
            *("--served-model-name", MODEL, "--speed", "50", "--shm-dir", str(workdir / "shm")),
            *("--engine-id", "gpu", "--log-level", "WARNING"),
        ]
        gpu = start(sim, workdir, "gpu")
        routers: list[Child] = []
        try:
            routers = start_routers(args, workdir, gpu)
            time.sleep(2)  # every worker's first heartbeat
            urls = [router.url for router in routers]
            burst = asyncio.run(drain(urls))
            ok, refused, other = asyncio.run(offer(urls, args.rate, args.seconds))
        finally:
            for child in (*routers, gpu):
                child.stop()
        fallbacks = sum(r.log.read_text(errors="replace").count(FALLBACK_LINE) for r in routers)
    per_minute = ok * 60.0 / args.seconds
    return {
        "burst": burst,
        "seconds": args.seconds,
        "offered_per_minute": args.rate * 60,
        "admitted": ok,
        "refused": refused,
        "other": other,
        "admitted_per_minute": round(per_minute, 1),
        "ratio": round(per_minute / args.rpm, 4),
        "fallbacks": fallbacks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    )
    parser.add_argument("--admissions", type=int, default=20000)
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rpm", type=int, default=600)
    parser.add_argument("--rate", type=float, default=30.0, help="requests a second offered")
    parser.add_argument("--seconds", type=float, default=60.0, help="the steady window")
    parser.add_argument(
        "--timeout", type=float, help="the routers' --shared-limits-timeout (default theirs)"
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-rpm", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results: dict[str, object] = {}
    if not args.skip_latency:
        row = asyncio.run(admission_latency(args.redis_url, args.admissions))
        results["latency"] = row
        print(
            f"admission latency over {args.admissions} each: local p50 {row['local_p50_us']} "
            f"p99 {row['local_p99_us']} us; shared p50 {row['shared_p50_us']} p99 "
            f"{row['shared_p99_us']} us; added p50 {row['added_p50_us']} p99 "
            f"{row['added_p99_us']} us; fallbacks {row['fallbacks']:.0f}"
        )
    if not args.skip_rpm:
        row2 = rpm_across_routers(args)
        results["rpm"] = row2
        print(
            f"rpm {args.rpm} across {args.routers} routers x {args.workers} workers, "
            f"{row2['offered_per_minute']:.0f} offered a minute for {args.seconds:.0f} s after a "
            f"burst of {row2['burst']}: admitted {row2['admitted_per_minute']} a minute, ratio "
            f"{row2['ratio']}, refused {row2['refused']}, other {row2['other']}, fallbacks "
            f"{row2['fallbacks']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
