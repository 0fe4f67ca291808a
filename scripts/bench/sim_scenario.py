"""Run MISSION.md's short scenario against live simulator processes, measured by a client.

    .venv/bin/python scripts/bench/sim_scenario.py                 # --speed 10, concurrency 2
    .venv/bin/python scripts/bench/sim_scenario.py --speed 1 --requests 20

Starts a GPU engine (a100-80gb) and a CPU engine (kunpeng-920-7280z), both serving
DeepSeek-R1-Distill-Qwen-32B q4_0, and drives each with a closed loop of --concurrency
streaming clients (128-token prompts, 256 output tokens). Client-side wall times are scaled
back to simulated time by --speed. Prints the documented baseline, the virtual-time model
(scripts/bench/sim_calibrate.py's figure) and the live measurement side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from common.presets import DEVICES, MODELS
from common.supervisor import ReadyChild, python_argv
from sim.engine import EngineConfig
from sim.virtual import closed_loop

MODEL = "deepseek-r1-distill-qwen-32b"
BASELINES = {"a100-80gb": (158.2, 146.0), "kunpeng-920-7280z": (32.6, 892.0)}
PROMPT = " ".join(f"word{i}" for i in range(128))


async def one_request(
    client: httpx.AsyncClient, url: str, out: list[tuple[float, float, int]]
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 256, "stream": True}
    start = time.monotonic()
    first = 0.0
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and '"text":" ' in line:
                tokens += 1
                if not first:
                    first = time.monotonic()
    out.append((first - start, time.monotonic(), tokens))


async def closed_loop_live(url: str, concurrency: int, requests: int) -> tuple[float, float]:
    """(completion tokens per wall second, mean TTFT wall seconds)."""
    results: list[tuple[float, float, int]] = []
    queue = list(range(requests))
    start = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            queue.pop()
            await one_request(client, url, results)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    end = max(r[1] for r in results)
    return sum(r[2] for r in results) / (end - start), statistics.fmean(r[0] for r in results)


def launch(tmp: Path, device: str, speed: float) -> ReadyChild:
    cmd = python_argv(
        "sim", "--device", device, "--model", MODEL, "--speed", str(speed),
        "--kv-cache-space", "40", "--log-level", "WARNING",
    )  # fmt: skip
    return ReadyChild(device, cmd, tmp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    print(
        f"short scenario (128 in / 256 out), {MODEL}, concurrency {args.concurrency}, "
        f"{args.requests} requests, live at --speed {args.speed}"
    )
    print("| device | throughput tok/s doc / model / live | TTFT ms doc / model / live |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for device, (thr_doc, ttft_doc) in BASELINES.items():
            cfg = EngineConfig(
                device=DEVICES[device], model=MODELS[MODEL], served_model_name=MODEL,
                engine_id="model", kv_cache_space_gb=40,
            )  # fmt: skip
            model = closed_loop(
                replace(cfg), concurrency=args.concurrency, prompt_tokens=128, max_tokens=256,
                requests=args.requests,
            )  # fmt: skip
            with launch(Path(tmp), device, args.speed) as engine:
                thr, ttft = asyncio.run(
                    closed_loop_live(engine.url, args.concurrency, args.requests)
                )
            print(
                f"| {device} | {thr_doc} / {model.throughput_tok_s:.1f} / "
                f"{thr / args.speed:.1f} | {ttft_doc:.0f} / {model.ttft_mean_s * 1000:.0f} / "
                f"{ttft * args.speed * 1000:.0f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
