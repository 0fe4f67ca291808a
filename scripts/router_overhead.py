"""Measure what the router costs, side by side with hitting the engine directly, in one run.

    .venv/bin/python scripts/router_overhead.py [--quick] [--json out.json]

Starts one simulated GPU engine (and a CPU one for the spliced PD figure) and one router,
then for each concurrency (1, 16, 64, 256 streams) alternates rounds straight to the engine
and through the router (gpu-only passthrough), and reports TTFT p50/p99 for both and the
difference. It then measures the router's CPU seconds per 1000 streamed tokens (from
/proc, passthrough and PD-spliced) and the streamed-token rate with the router pinned to one
core. Figures from a shared 2-core machine are noisy: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
MODEL = "m"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Child:
    popen: subprocess.Popen[bytes]
    url: str

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def start(args: list[str], workdir: Path, name: str, cpus: set[int] | None) -> Child:
    ready = workdir / f"{name}.port"
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
    popen = subprocess.Popen(
        [sys.executable, "-m", "syshax.cli", *args, "--port", "0", "--ready-file", str(ready)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    if cpus:
        os.sched_setaffinity(popen.pid, cpus)
    deadline = time.monotonic() + 30
    while not (ready.exists() and ready.read_text().strip()):
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start; see {workdir / (name + '.log')}")
        time.sleep(0.05)
    return Child(popen, f"http://127.0.0.1:{ready.read_text().strip()}")


async def one_stream(
    session: aiohttp.ClientSession, url: str, max_tokens: int
) -> tuple[float, int]:
    """(TTFT seconds, streamed token events) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": "benchmark the router overhead please",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    ttft = 0.0
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for data in resp.content.iter_any():
            if not ttft:
                ttft = time.perf_counter() - started
            # Count events cheaply; the last two are the finish chunk and [DONE].
            tokens += data.count(b"data:")
    return ttft, max(0, tokens - 2)


async def wave(
    url: str, streams: int, per_stream: int, max_tokens: int, jitter: float = 0.0
) -> tuple[list[float], int]:
    """``streams`` closed-loop workers; with ``jitter`` each waits uniform(0, jitter) s before
    every request, so arrivals are independent instead of the engine's lock-step bursts."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> tuple[list[float], int]:
            ttfts, tokens = [], 0
            for _ in range(per_stream):
                if jitter:
                    await asyncio.sleep(random.uniform(0.0, jitter))
                ttft, n = await one_stream(session, url, max_tokens)
                ttfts.append(ttft)
                tokens += n
            return ttfts, tokens

        results = await asyncio.gather(*(worker() for _ in range(streams)))
    return [t for r in results for t in r[0]], sum(r[1] for r in results)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ttft_table(
    engine: str, router: Child, quick: bool, jitter: float
) -> list[dict[str, Any]]:
    rows = []
    arrivals = f"independent (uniform 0-{jitter * 1000:g} ms gaps)" if jitter else "in bursts"
    print(f"TTFT, arrivals {arrivals}")
    for streams in (1, 16, 64, 256):
        per_stream = max(2, (120 if quick else 400) // streams)
        direct: list[float] = []
        routed: list[float] = []
        router_cpu = 0.0
        for _ in range(2):  # alternate so drift hits both columns alike
            direct += (await wave(engine, streams, per_stream, 8, jitter))[0]
            cpu0 = router.cpu_seconds()
            routed += (await wave(router.url, streams, per_stream, 8, jitter))[0]
            router_cpu += router.cpu_seconds() - cpu0
        row = {
            "streams": streams,
            "requests_each": len(direct),
            "direct_p50_ms": 1000 * pct(direct, 0.5),
            "router_p50_ms": 1000 * pct(routed, 0.5),
            "direct_p99_ms": 1000 * pct(direct, 0.99),
            "router_p99_ms": 1000 * pct(routed, 0.99),
            "router_cpu_ms_per_request": 1000 * router_cpu / len(routed),
        }
        row["added_p50_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
        row["added_p99_ms"] = row["router_p99_ms"] - row["direct_p99_ms"]
        rows.append(row)
        print(
            f"{streams:>4} streams  TTFT p50 direct {row['direct_p50_ms']:7.2f} ms  "
            f"router {row['router_p50_ms']:7.2f} ms  added {row['added_p50_ms']:+6.2f} ms   "
            f"p99 direct {row['direct_p99_ms']:7.2f}  router {row['router_p99_ms']:7.2f}  "
            f"added {row['added_p99_ms']:+6.2f} ms   router CPU "
            f"{row['router_cpu_ms_per_request']:.2f} ms/request",
            flush=True,
        )
    return rows


async def throughput(router: Child, seconds: float, streams: int) -> dict[str, float]:
    """Streamed tokens/s through the router and its CPU seconds per 1000 tokens."""
    cpu0 = router.cpu_seconds()
    t0 = time.perf_counter()
    tokens = 0
    while time.perf_counter() - t0 < seconds:
        tokens += (await wave(router.url, streams, 1, 256))[1]
    elapsed = time.perf_counter() - t0
    cpu = router.cpu_seconds() - cpu0
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "router_cpu_s_per_1000_tokens": 1000 * cpu / tokens,
        "router_cpu_utilisation": cpu / elapsed,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    # TTFT runs with nothing pinned, so both columns get the same scheduler freedom on a
    # shared machine; only the one-core throughput phase pins the router.
    cores = sorted(os.sched_getaffinity(0))
    router_core = {cores[0]}
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    (work / "shm").mkdir()
    sim = [
        "--model",
        "deepseek-r1-distill-qwen-32b",
        "--served-model-name",
        MODEL,
        "--speed",
        str(args.speed),
        "--shm-dir",
        str(work / "shm"),
        "--log-level",
        "WARNING",
    ]
    children: list[Child] = []
    try:
        gpu = start(["sim", "--device", "h100-80gb", *sim], work, "gpu", None)
        children.append(gpu)
        cpu = start(["sim", "--device", "kunpeng-920-7280z", *sim], work, "cpu", None)
        children.append(cpu)
        common = [
            "--gpu-url",
            gpu.url,
            "--cpu-url",
            cpu.url,
            "--model",
            MODEL,
            "--log-level",
            "WARNING",
        ]
        router = start(["router", *common, "--mode", "gpu-only"], work, "router", None)
        children.append(router)
        pd_router = start(["router", *common, "--mode", "forced-pd"], work, "pdrouter", None)
        children.append(pd_router)
        print(
            f"{len(cores)} CPUs, load average {os.getloadavg()[0]:.2f}; sim speed {args.speed:g}x",
            flush=True,
        )
        await wave(router.url, 4, 2, 4)  # warm both paths
        await wave(gpu.url, 4, 2, 4)
        table = await ttft_table(gpu.url, router, args.quick, 0.0)
        staggered = await ttft_table(gpu.url, router, args.quick, 0.05)
        seconds = 5.0 if args.quick else 12.0
        for child in (router, pd_router):
            os.sched_setaffinity(child.popen.pid, router_core)
        print(f"throughput: routers pinned to CPU {sorted(router_core)}", flush=True)
        passthrough = await throughput(router, seconds, 64)
        spliced = await throughput(pd_router, seconds, 8)
        for name, fig in (
            ("passthrough (gpu-only)", passthrough),
            ("spliced (forced-pd)", spliced),
        ):
            print(
                f"{name:>24}: {fig['tokens_per_s']:8.0f} tok/s streamed, router "
                f"{fig['router_cpu_s_per_1000_tokens'] * 1000:6.2f} ms CPU per 1000 tokens, "
                f"router core {100 * fig['router_cpu_utilisation']:5.1f}% busy -> ceiling "
                f"{1000 / fig['router_cpu_s_per_1000_tokens']:8.0f} tok/s on one core",
                flush=True,
            )
        result = {
            "ttft_bursts": table,
            "ttft_independent": staggered,
            "passthrough": passthrough,
            "spliced_pd": spliced,
            "speed": args.speed,
            "router_core": sorted(router_core),
        }
        for name, rows in (("bursts", table), ("independent arrivals", staggered)):
            at64 = next(r for r in rows if r["streams"] == 64)
            print(
                f"target at 64 streams, {name}: added p50 {at64['added_p50_ms']:+.2f} ms "
                f"(<= 1), added p99 {at64['added_p99_ms']:+.2f} ms (<= 5)"
            )
        return result
    finally:
        for child in reversed(children):
            child.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, shorter runs")
    parser.add_argument("--speed", type=float, default=20.0, help="simulator time compression")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
