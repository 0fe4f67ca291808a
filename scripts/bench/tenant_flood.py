#!/usr/bin/env python3
"""One tenant floods the router, another sends steady requests: both tenants' latencies,
with and without flow control (docs/slo-classes.md, "Flow control").

    .venv/bin/python scripts/bench/tenant_flood.py [--reps 3] [--seconds 10] [--flood 48]
        [--steady-rate 2] [--queue 8] [--speed 20] [--json FILE]

Starts a simulated GPU engine and CPU engine (``syshax sim``, scheduling by priority) and,
per setting, one standalone router with a tenants file of two tenants, ``flood`` and
``steady``. For each repetition the settings run in turn:

- ``off``: ``max_queue_size 0``, both tenants in the standard class without limits: a
  saturated deployment answers 429 at once, as before flow control, to every tenant alike;
- ``flow control``: ``max_queue_size --queue``: saturated requests wait in the router's queue,
  served tenant by tenant, and a flood cannot fill the queue against another tenant;
- ``classes``: as ``flow control``, with the flooding tenant's traffic in the batch class
  (its only class) and the steady tenant's interactive, the engines told each request's
  priority (``--priority-scheduling``): batch decodes go to the CPU first and wait behind
  interactive requests in every queue;
- ``rpm limit``: as ``flow control``, with the flooding tenant held to ``--flood-rpm``
  requests a minute.

Tenant ``flood`` runs ``--flood`` closed-loop streams (the next request as soon as the last
one ends; after a 429 it pauses 50 ms), tenant ``steady`` an open loop of ``--steady-rate``
requests a second. Each repetition prints both tenants' TTFT p50/p99 (answered requests) and
how many were answered and refused; the summary is the median over repetitions. Figures from a
shared machine are noisy: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"
KEYS = {"flood": "sk-shx-flood-bench", "steady": "sk-shx-steady-bench"}
KV_TRANSFER_CONFIG = '{"kv_connector": "SyshaxShmConnector", "kv_role": "kv_both"}'


@dataclass
class Child:
    popen: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def start(args: list[str], workdir: Path, name: str) -> Child:
    ready = workdir / f"{name}.port"
    ready.unlink(missing_ok=True)
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
    popen = subprocess.Popen(
        [sys.executable, "-m", "syshax.cli", *args, "--port", "0", "--ready-file", str(ready)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while not (ready.exists() and ready.read_text().strip()):
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start; see {workdir / (name + '.log')}")
        time.sleep(0.05)
    return Child(popen, f"http://127.0.0.1:{ready.read_text().strip()}")


def start_sim(name: str, device: str, workdir: Path, speed: float) -> Child:
    return start(
        [
            "sim",
            "--device",
            device,
            "--model",
            "deepseek-r1-distill-qwen-32b",
            "--served-model-name",
            MODEL,
            "--speed",
            str(speed),
            "--shm-dir",
            str(workdir / "shm"),
            "--engine-id",
            name,
            "--kv-transfer-config",
            KV_TRANSFER_CONFIG,
            "--enable-prompt-tokens-details",
            "--scheduling-policy",
            "priority",
            "--log-level",
            "WARNING",
        ],
        workdir,
        name,
    )


@dataclass(frozen=True)
class Setting:
    label: str
    queue: int
    classes: bool = False  # flood in batch, steady interactive, engines told the priority
    flood_rpm: int = 0


def start_router(gpu: Child, cpu: Child, workdir: Path, setting: Setting) -> Child:
    tenants = workdir / "tenants.json"
    records: list[dict[str, object]] = [
        {"name": name, "keys": [hashlib.sha256(key.encode()).hexdigest()]}
        for name, key in KEYS.items()
    ]
    if setting.classes:
        records[0].update(classes=["batch"], default_class="batch")
        records[1].update(classes=["interactive"], default_class="interactive")
    records[0]["rpm_limit"] = setting.flood_rpm
    tenants.write_text(json.dumps({"tenants": records}))
    queue = setting.queue
    extra = ["--priority-scheduling"] if setting.classes else []
    return start(
        [
            "router",
            "--gpu-url",
            gpu.url,
            "--cpu-url",
            cpu.url,
            "--model",
            MODEL,
            "--tenants-file",
            str(tenants),
            # A small GPU and CPU as the router sees them, so the flood saturates both.
            "--max-num-seqs",
            "8",
            "--cpu-max-batch-size",
            "2",
            "--metrics-interval-seconds",
            "0.25",
            "--max-queue-size",
            str(queue),
            "--log-level",
            "WARNING",
            *extra,
        ],
        workdir,
        "router",
    )


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    refused: int = 0
    failed: int = 0

    def row(self) -> dict[str, float]:
        ttfts = sorted(self.ttfts)

        def pct(q: float) -> float:
            if not ttfts:
                return float("nan")
            return 1000.0 * ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]

        return {
            "ttft_p50_ms": pct(0.5),
            "ttft_p99_ms": pct(0.99),
            "answered": float(len(ttfts)),
            "refused": float(self.refused),
            "failed": float(self.failed),
        }


async def one(client: httpx.AsyncClient, url: str, tenant: str, tally: Tally, tokens: int) -> int:
    """One streamed request; its TTFT into ``tally``. Returns the HTTP status."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about flow control."}],
        "max_tokens": tokens,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    started = time.perf_counter()
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                if response.status_code == 429:
                    tally.refused += 1
                else:
                    tally.failed += 1
                return response.status_code
            first: float | None = None
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and '"content"' in line:
                    first = time.perf_counter() - started
            if first is not None:
                tally.ttfts.append(first)
            return 200
    except httpx.HTTPError:
        tally.failed += 1
        return 0


async def run_window(url: str, seconds: float, flood: int, rate: float, tokens: int) -> dict:
    tallies = {"flood": Tally(), "steady": Tally()}
    limits = httpx.Limits(max_connections=flood + 64, max_keepalive_connections=flood + 64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        end = time.monotonic() + seconds

        async def flooder() -> None:
            while time.monotonic() < end:
                if await one(client, url, "flood", tallies["flood"], tokens) != 200:
                    await asyncio.sleep(0.05)

        async def steady() -> None:
            sent: list[asyncio.Task[int]] = []
            start = time.monotonic()
            n = 0
            while time.monotonic() < end:
                sent.append(
                    asyncio.create_task(one(client, url, "steady", tallies["steady"], tokens))
                )
                n += 1
                await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            await asyncio.gather(*sent)

        await asyncio.gather(*(flooder() for _ in range(flood)), steady())
    return {tenant: tally.row() for tenant, tally in tallies.items()}


def median_rows(rows: list[dict]) -> dict:
    out: dict[str, dict[str, float]] = {}
    for tenant in ("flood", "steady"):
        out[tenant] = {
            key: statistics.median(row[tenant][key] for row in rows) for key in rows[0][tenant]
        }
    return out


def show(label: str, result: dict) -> None:
    for tenant, row in result.items():
        print(
            f"{label:<26} {tenant:<7} p50 {row['ttft_p50_ms']:8.1f} ms  p99 "
            f"{row['ttft_p99_ms']:8.1f} ms  answered {row['answered']:5.0f}  "
            f"refused {row['refused']:5.0f}  failed {row['failed']:3.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    parser.add_argument("--flood", type=int, default=48, help="the flooding tenant's streams")
    parser.add_argument("--steady-rate", type=float, default=2.0, help="steady requests/s")
    parser.add_argument("--queue", type=int, default=8, help="max_queue_size with flow control")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--speed", type=float, default=20.0, help="simulator time compression")
    parser.add_argument(
        "--flood-rpm", type=int, default=600, help="the flooding tenant's limit in 'rpm limit'"
    )
    parser.add_argument("--json", type=Path, help="write the per-repetition rows here")
    args = parser.parse_args()
    settings = [
        Setting("off (queue 0)", 0),
        Setting(f"flow control (queue {args.queue})", args.queue),
        Setting("classes", args.queue, classes=True),
        Setting(f"rpm limit {args.flood_rpm}", args.queue, flood_rpm=args.flood_rpm),
    ]
    rows: dict[str, list[dict]] = {setting.label: [] for setting in settings}
    with tempfile.TemporaryDirectory(prefix="tenant-flood-") as tmp:
        workdir = Path(tmp)
        (workdir / "shm").mkdir()
        gpu = start_sim("gpu", "h100-80gb", workdir, args.speed)
        cpu = start_sim("cpu", "kunpeng-920-7280z", workdir, args.speed)
        try:
            for rep in range(args.reps):
                for setting in settings:
                    label = setting.label
                    router = start_router(gpu, cpu, workdir, setting)
                    try:
                        time.sleep(1.0)  # the first scrapes
                        result = asyncio.run(
                            run_window(
                                router.url, args.seconds, args.flood, args.steady_rate, args.tokens
                            )
                        )
                    finally:
                        router.stop()
                    rows[label].append(result)
                    show(f"rep {rep + 1} {label}", result)
                    time.sleep(1.0)  # the engines drain
        finally:
            cpu.stop()
            gpu.stop()
    print(
        f"\nmedians of {args.reps} repetitions ({args.seconds:g} s windows, "
        f"{args.flood} flood streams, {args.steady_rate:g} steady req/s):"
    )
    for setting in settings:
        show(setting.label, median_rows(rows[setting.label]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
