"""Calibrate the simulator's efficiency factors against the documented baselines.

    .venv/bin/python scripts/bench/sim_calibrate.py            # solve, then compare with presets
    .venv/bin/python scripts/bench/sim_calibrate.py --concurrency 4

Method: the short scenario (128 prompt tokens, 256 output tokens) as a closed loop of
``--concurrency`` clients for ``--requests`` requests, run on the real batch scheduler in
virtual time (sim/virtual.py). Throughput = completion tokens / makespan; TTFT = mean.
For each baseline device, bisect the bandwidth efficiency until throughput matches and the
FLOP efficiency until TTFT matches (alternating, since each moves both a little). Prints the
solved factors, the presets' factors, and the simulated figures next to the documented ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

from common.presets import DEVICES, MODELS
from sim.engine import EngineConfig
from sim.virtual import ScenarioResult, closed_loop, with_efficiency

MODEL = "deepseek-r1-distill-qwen-32b"
# MISSION.md, short scenario: (device, throughput tok/s, TTFT s, mean token latency ms)
BASELINES = [("a100-80gb", 158.2, 0.146, 6.3), ("kunpeng-920-7280z", 32.6, 0.892, 30.7)]


def scenario(cfg: EngineConfig, concurrency: int, requests: int) -> ScenarioResult:
    return closed_loop(
        cfg, concurrency=concurrency, prompt_tokens=128, max_tokens=256, requests=requests
    )


def bisect(fn: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with fn(x) == target for an increasing fn."""
    for _ in range(24):
        mid = (lo + hi) / 2
        if fn(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _throughput(base: EngineConfig, c: int, n: int, fl: float, bw: float) -> float:
    return scenario(with_efficiency(base, bw, fl), c, n).throughput_tok_s


def _neg_ttft(base: EngineConfig, c: int, n: int, bw: float, fl: float) -> float:
    return -scenario(with_efficiency(base, bw, fl), c, n).ttft_mean_s


def solve(
    device: str, thr: float, ttft: float, concurrency: int, requests: int
) -> tuple[float, float]:
    base = EngineConfig(
        device=DEVICES[device], model=MODELS[MODEL], served_model_name=MODEL, engine_id="cal",
        kv_cache_space_gb=40,
    )  # fmt: skip
    bw, fl = base.device.bw_efficiency, base.device.flops_efficiency
    for _ in range(3):
        bw = bisect(partial(_throughput, base, concurrency, requests, fl), thr, 0.01, 1.5)
        # TTFT falls as FLOP efficiency rises: bisect on its negation.
        fl = bisect(partial(_neg_ttft, base, concurrency, requests, bw), -ttft, 0.01, 1.5)
    return bw, fl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    c, n = args.concurrency, args.requests
    print(f"short scenario, {MODEL}, concurrency {c}, {n} requests, virtual time")
    print(
        "| device | bw eff (solved / preset) | FLOP eff (solved / preset) | throughput tok/s "
        "(doc / sim) | TTFT ms (doc / sim) | mean token latency ms = 1/throughput (doc / sim) "
        "| per-stream TPOT ms (sim) |"
    )
    print("|---|---|---|---|---|---|---|")
    for device, thr, ttft, mtl in BASELINES:
        bw, fl = solve(device, thr, ttft, c, n)
        preset = DEVICES[device]
        cfg = EngineConfig(
            device=preset, model=MODELS[MODEL], served_model_name=MODEL, engine_id="cal",
            kv_cache_space_gb=40,
        )  # fmt: skip
        r = scenario(cfg, c, n)
        print(
            f"| {device} | {bw:.3f} / {preset.bw_efficiency:.3f} | {fl:.3f} / "
            f"{preset.flops_efficiency:.3f} | {thr} / {r.throughput_tok_s:.1f} | "
            f"{ttft * 1000:.0f} / {r.ttft_mean_s * 1000:.0f} | {mtl} / "
            f"{1000 / r.throughput_tok_s:.1f} | {r.tpot_mean_s * 1000:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
