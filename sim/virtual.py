"""Run the batch scheduler in virtual time: a closed-loop benchmark without sleeping.

Used by calibration (``scripts/bench/sim_calibrate.py``) and by tests that pin the performance
model. The same scheduler code runs inside the live engine, so what this reports is what a
live run at any ``--speed`` produces, minus network and timer noise.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from common.presets import DevicePreset
from sim.engine import EngineConfig, build_scheduler, plan_capacity
from sim.perfmodel import effective_hardware
from sim.scheduler import Sequence
from sim.tokens import TokenModel

# A benchmark client's time from reading a response's end to sending its next request.
CLIENT_TURNAROUND_S = 0.001


@dataclass(frozen=True)
class ScenarioResult:
    concurrency: int
    requests: int
    throughput_tok_s: float  # completion tokens / (last token - first arrival)
    ttft_mean_s: float
    ttft_p99_s: float
    tpot_mean_s: float  # per request: (last - first token) / (tokens - 1), then averaged
    e2e_p99_s: float


def closed_loop(
    config: EngineConfig,
    *,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    requests: int,
    turnaround_s: float = CLIENT_TURNAROUND_S,
) -> ScenarioResult:
    """``concurrency`` clients, each sending its next request ``turnaround_s`` (plus 20% per
    client index, so clients do not stay in artificial lockstep) after its last one ends.

    All clients start at time 0. Arrivals between steps wait for the running step, as in a
    live engine; an idle engine starts a step on arrival.
    """
    capacity = plan_capacity(config)
    hw = effective_hardware(config.device, config.tensor_parallel_size)
    sched = build_scheduler(config, capacity, hw, TokenModel(config.seed))
    now = 0.0
    issued = 0
    done: list[Sequence] = []
    arrivals: list[tuple[float, int]] = []  # (time, client) of requests not yet sent

    def issue(at: float) -> None:
        nonlocal issued
        seq = Sequence(
            request_id=str(issued),
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_tokens,
            tail=[issued],
            arrival=at,
        )
        issued += 1
        sched.add(seq)

    for client in range(min(concurrency, requests)):
        arrivals.append((0.0, client))
    while arrivals or sched.has_work():
        arrivals.sort()
        while arrivals and arrivals[0][0] <= now:
            at, _ = arrivals.pop(0)
            issue(at)
        step = sched.plan(now)
        if step is None:
            if not arrivals:
                raise RuntimeError("scheduler stalled with work queued")
            now = arrivals[0][0]  # idle until the next request arrives
            continue
        now += step.duration
        result = sched.complete(step, now)
        for seq in result.finished:
            done.append(seq)
            if issued + len(arrivals) < requests:
                client = int(seq.request_id) % concurrency
                arrivals.append((now + turnaround_s * (1 + 0.2 * client), client))
    ttfts = sorted((s.first_token_at or 0.0) - s.arrival for s in done)
    e2es = sorted((s.last_token_at or 0.0) - s.arrival for s in done)
    tpots = [
        ((s.last_token_at or 0.0) - (s.first_token_at or 0.0)) / (s.generated - 1)
        for s in done
        if s.generated > 1
    ]
    tokens = sum(s.generated for s in done)
    return ScenarioResult(
        concurrency=concurrency,
        requests=len(done),
        throughput_tok_s=tokens / now if now else 0.0,
        ttft_mean_s=statistics.fmean(ttfts),
        ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        tpot_mean_s=statistics.fmean(tpots) if tpots else 0.0,
        e2e_p99_s=e2es[min(len(e2es) - 1, int(0.99 * len(e2es)))],
    )


def with_efficiency(config: EngineConfig, bw: float, flops: float) -> EngineConfig:
    device: DevicePreset = replace(config.device, bw_efficiency=bw, flops_efficiency=flops)
    return replace(config, device=device)
