"""Goodput sweeps of benchmark pairs in virtual time: GPU alone, CPU alone, hetero with the
default (capacity) policy and with sysHAX's threshold policy, on the same engines.

``scripts/bench/goodput_sweep.py`` is the command; docs/benchmarks.md ("Goodput at SLO") has its
tables. The pairs and SLOs are defined here so the script, the tests and the docs agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from common.decisions import Mode
from common.policy_schema import PolicyKnobs
from common.presets import GIB, device_preset, model_preset
from hetero.virtual import Request, RunStats, VirtualDeployment
from loadgen.goodput import GoodputSearch, RatePoint
from loadgen.scenarios import Scenario
from loadgen.stats import SLO
from sim.engine import EngineConfig, plan_capacity
from sim.perfmodel import (
    bind_cpu,
    decode_step_time,
    effective_hardware,
    prefill_time,
)

MODES = ("gpu", "cpu", "hetero", "syshax-threshold")
# The policy's CPU latency SLO as a share of the benchmark's TPOT SLO. 0.9 (room for the KV
# handoff and a scrape's lag) measured worse than 1.0 in every saturation scenario (A10
# decode-heavy: 0.28 against 0.35 req/s): the CPU's batch, not its margin, sets the gain.
CPU_SLO_MARGIN = 1.0


@dataclass(frozen=True)
class Pair:
    name: str
    gpu: EngineConfig
    cpu: EngineConfig
    slo_ttft_ms: float
    slo_tpot_ms: float
    note: str


def _pair(
    name: str,
    gpu: str,
    cpu: str,
    model: str,
    *,
    cpu_bind: str,
    cpu_kv_gb: float,
    cpu_max_num_seqs: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    note: str,
) -> Pair:
    m = model_preset(model)
    cpu_device = bind_cpu(device_preset(cpu), cpu_bind)
    return Pair(
        name,
        EngineConfig(device_preset(gpu), m, model, f"{name}-gpu", max_num_seqs=256),
        EngineConfig(
            cpu_device,
            m,
            model,
            f"{name}-cpu",
            max_num_seqs=cpu_max_num_seqs,
            kv_cache_space_gb=cpu_kv_gb,
        ),
        slo_ttft_ms,
        slo_tpot_ms,
        note,
    )


PAIRS: dict[str, Pair] = {
    p.name: p
    for p in (
        _pair(
            "a100-kunpeng",
            "a100-80gb",
            "kunpeng-920-7280z",
            "deepseek-r1-distill-qwen-32b",
            cpu_bind="all",
            cpu_kv_gb=64,
            cpu_max_num_seqs=64,
            slo_ttft_ms=5000,
            slo_tpot_ms=150,
            note="the source documents' pair: A100 80GB + 2x Kunpeng 920 7280Z, 32B q4_0",
        ),
        _pair(
            "a10-xeon",
            "a10-24gb",
            "xeon-8480",
            "qwen2.5-7b-instruct",
            cpu_bind="0-55",
            cpu_kv_gb=64,
            cpu_max_num_seqs=64,
            slo_ttft_ms=2000,
            slo_tpot_ms=100,
            note="memory-tight: A10 24GB + one socket of a Xeon 8480+, Qwen2.5-7B bf16",
        ),
    )
}


def pair_knobs(pair: Pair, mode: str) -> PolicyKnobs:
    """The policy of ``mode`` at the pair's SLO."""
    base = PolicyKnobs()
    if mode == "gpu":
        return replace(base, mode=Mode.GPU_ONLY)
    if mode == "cpu":
        return replace(base, mode=Mode.CPU_ONLY)
    knee = min(base.gpu_decode_slo_ms, CPU_SLO_MARGIN * pair.slo_tpot_ms)
    common = replace(
        base,
        cpu_decode_slo_ms=CPU_SLO_MARGIN * pair.slo_tpot_ms,
        gpu_decode_slo_ms=knee,
        cpu_max_batch_size=pair.cpu.max_num_seqs,
    )
    if mode == "hetero":
        return common
    if mode == "syshax-threshold":
        return replace(common, algorithm="syshax-threshold")
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def deployment(pair: Pair, mode: str, knobs: PolicyKnobs | None = None) -> VirtualDeployment:
    """The pair's engines for ``mode``, under ``knobs`` (default: the mode's policy at the
    pair's SLO)."""
    knobs = knobs or pair_knobs(pair, mode)
    gpu = None if mode == "cpu" else pair.gpu
    cpu = None if mode == "gpu" else pair.cpu
    return VirtualDeployment(gpu, cpu, knobs)


def gpu_saturation_rate(pair: Pair, scenario: Scenario) -> float:
    """Requests/s at which the GPU alone runs out of KV or bandwidth (a first estimate only;
    the sweep measures the real knee)."""
    cap = plan_capacity(pair.gpu)
    hw = effective_hardware(pair.gpu.device)
    model = pair.gpu.model
    full = scenario.input_tokens + scenario.output_tokens
    mean_context = scenario.input_tokens + scenario.output_tokens // 2
    kv_tokens = cap.num_blocks * pair.gpu.block_size
    seqs = max(1, min(pair.gpu.max_num_seqs, kv_tokens // full))
    step = decode_step_time(hw, model, seqs, mean_context)
    decode_s = scenario.output_tokens * step / seqs  # GPU seconds per request's decode
    prefill_s = prefill_time(hw, model, scenario.input_tokens)
    return 1.0 / (decode_s + prefill_s)


def derivation(pair: Pair, scenario: Scenario) -> list[str]:
    """How the scenario saturates the pair, from the presets: printed by the sweep."""
    cap = plan_capacity(pair.gpu)
    model = pair.gpu.model
    hw = effective_hardware(pair.gpu.device)
    cpu_hw = effective_hardware(pair.cpu.device)
    full = scenario.input_tokens + scenario.output_tokens
    kv_tokens = cap.num_blocks * pair.gpu.block_size
    seqs = kv_tokens // full
    mean_context = scenario.input_tokens + scenario.output_tokens // 2
    return [
        f"{pair.gpu.device.description} + {pair.cpu.device.description}, {model.name} "
        f"({model.quantization})",
        f"KV per token: 2 x {model.layers} layers x {model.kv_heads} KV heads x "
        f"{model.head_dim} x {model.kv_dtype_bytes} B = {model.kv_bytes_per_token / 1024:.0f} KiB",
        f"GPU KV cache: {cap.kv_bytes / GIB:.1f} GiB = {kv_tokens:,} tokens; a request of "
        f"{scenario.input_tokens}+{scenario.output_tokens} tokens holds up to "
        f"{full * model.kv_bytes_per_token / GIB:.2f} GiB, so {seqs} run at full length "
        f"(max_num_seqs {pair.gpu.max_num_seqs})",
        f"GPU decode step at that batch: "
        f"{1000 * decode_step_time(hw, model, max(1, seqs), mean_context):.1f} ms; "
        f"prefill of one prompt: {1000 * prefill_time(hw, model, scenario.input_tokens):.0f} ms",
        "CPU decode step at batch 1 / 16 / 32: "
        + " / ".join(
            f"{1000 * decode_step_time(cpu_hw, model, b, mean_context):.0f}" for b in (1, 16, 32)
        )
        + f" ms (TPOT SLO {pair.slo_tpot_ms:g} ms)",
        f"GPU saturates near {gpu_saturation_rate(pair, scenario):.2f} req/s "
        "(KV-bound batch, its decode and prefill time per request)",
    ]


def default_rates(pair: Pair, scenario: Scenario) -> tuple[float, ...]:
    """A sweep around the GPU's estimated knee, rounded to two significant figures."""
    knee = gpu_saturation_rate(pair, scenario)
    out: list[float] = []
    for factor in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0):
        value = knee * factor
        digits = 1 - math.floor(math.log10(value))
        rounded = round(value, digits)
        if not out or rounded > out[-1]:
            out.append(rounded)
    return tuple(out)


def measure(
    pair: Pair,
    scenario: Scenario,
    mode: str,
    rate: float,
    *,
    requests: int,
    seed: int = 0,
    knobs: PolicyKnobs | None = None,
) -> tuple[RatePoint, RunStats]:
    stats = deployment(pair, mode, knobs).run(
        rate=rate,
        requests=requests,
        prompt_tokens=scenario.input_tokens,
        output_tokens=scenario.output_tokens,
        seed=seed,
    )
    good = sum(1 for r in stats.requests if met(r, pair))
    point = RatePoint(
        rate=rate,
        requests=len(stats.requests),
        good=good,
        duration_s=stats.duration_s,
        output_tokens=sum(r.tokens for r in stats.requests if r.ok),
    )
    return point, stats


def met(request: Request, pair: Pair) -> bool:
    """Whether a request succeeded within the pair's TTFT and TPOT SLOs."""
    return SLO(pair.slo_ttft_ms, pair.slo_tpot_ms).met_by(request)


def sweep(
    pair: Pair,
    scenario: Scenario,
    mode: str,
    rates: tuple[float, ...],
    *,
    requests: int,
    target: float = 90.0,
    bisections: int = 4,
    seed: int = 0,
) -> tuple[GoodputSearch, dict[float, RunStats]]:
    search = GoodputSearch(rates, target=target, bisections=bisections)
    runs: dict[float, RunStats] = {}
    while (rate := search.next_rate()) is not None:
        point, stats = measure(pair, scenario, mode, rate, requests=requests, seed=seed)
        search.record(replace(point, bisection=rate not in rates))
        runs[rate] = stats
    return search, runs
