"""The deciders: pure functions from (policy knobs, device loads) to a routing decision.

No I/O here. ``backends.py`` builds the :class:`DeviceLoad` values from scraped metrics and
the router's own in-flight counts; ``server.py`` acts on the :class:`Decision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from router.engine_metrics import DeviceLoad
from syshax.policy_schema import PolicyKnobs


class Route(StrEnum):
    GPU_ONLY = "gpu-only"
    PD = "pd"
    CPU_ONLY = "cpu-only"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Decision:
    route: Route
    # Tokens the CPU decodes before the scheduler decides again; 0 = decode to the end.
    token_limit: int = 0
    reason: str = ""
    # True when the policy's first choice was impossible (an engine down) and this is the
    # next best; counted in the fallbacks metric.
    fallback: bool = False
    # For REJECTED: 429 (saturated, retry soon) or 503 (no engine can serve).
    status: int = 0


# Relative ITL growth per extra sequence when too few batch sizes were seen to fit a slope.
# Decode is memory-bandwidth bound, so one more sequence costs little until the knee.
DEFAULT_ITL_SLOPE_FRACTION = 0.05


def token_limit(knobs: PolicyKnobs, cpu_throughput_tps: float) -> int:
    """sysHAX's chunk size: multiplier x CPU throughput rounded to tens, clamped to [min, max]."""
    tokens = int(round(cpu_throughput_tps * knobs.token_limit_multiplier, -1))
    return min(max(tokens, knobs.token_limit_min), knobs.token_limit_max)


def fit_itl_slope(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (ms per extra sequence) of ITL against batch size, or None.

    ``samples`` are (running sequences, mean ITL ms) pairs from recent scrapes. A fit needs
    at least two distinct batch sizes; a negative slope (noise) is clamped to zero.
    """
    if len(samples) < 2:
        return None
    xs = [x for x, _ in samples]
    mean_x = sum(xs) / len(xs)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var <= 0:
        return None
    mean_y = sum(y for _, y in samples) / len(samples)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in samples)
    return max(0.0, cov / var)


def projected_itl_ms(load: DeviceLoad, slope_ms: float | None, extra: int = 1) -> float | None:
    """ITL the device would have with ``extra`` more sequences, or None if never measured."""
    if load.itl_ms is None:
        return None
    slope = slope_ms if slope_ms is not None else load.itl_ms * DEFAULT_ITL_SLOPE_FRACTION
    return load.itl_ms + slope * extra


def marginal_tps(load: DeviceLoad, slope_ms: float | None, unknown_itl_ms: float) -> float:
    """Decode tokens/s the device gains from one more sequence: (b+1)/itl(b+1) - b/itl(b)."""
    b = load.running
    now = load.itl_ms if load.itl_ms is not None else unknown_itl_ms
    after = projected_itl_ms(load, slope_ms)
    after = after if after is not None else now
    return 1000.0 * ((b + 1) / after - (b / now if b else 0.0))


@dataclass(frozen=True)
class Loads:
    gpu: DeviceLoad
    cpu: DeviceLoad
    gpu_itl_slope_ms: float | None = None
    cpu_itl_slope_ms: float | None = None
    # The CPU engine's own --max-num-seqs (None: unknown); it admits no more than that.
    cpu_max_num_seqs: int | None = None


def cpu_batch_limit(knobs: PolicyKnobs, loads: Loads) -> tuple[int, str]:
    """The most sequences the CPU may decode at once, and the name of the limit that binds:
    the policy's ``cpu_max_batch_size``, capped by the engine's ``max_num_seqs``."""
    engine = loads.cpu_max_num_seqs
    if engine is not None and engine < knobs.cpu_max_batch_size:
        return engine, "the CPU engine's max_num_seqs"
    return knobs.cpu_max_batch_size, "cpu_max_batch_size"


def gpu_room(knobs: PolicyKnobs, loads: Loads) -> tuple[bool, str]:
    gpu = loads.gpu
    if gpu.running >= knobs.max_num_seqs:
        return False, f"GPU running {gpu.running} >= max_num_seqs {knobs.max_num_seqs}"
    if gpu.kv_usage_perc >= knobs.gpu_cache_threshold:
        return False, f"GPU KV {gpu.kv_usage_perc:.1f}% >= {knobs.gpu_cache_threshold:g}%"
    itl = projected_itl_ms(gpu, loads.gpu_itl_slope_ms)
    if itl is not None and itl > knobs.gpu_decode_slo_ms:
        return False, f"GPU ITL would be {itl:.1f} ms > knee {knobs.gpu_decode_slo_ms:g} ms"
    return True, "GPU below its KV and latency knee"


def cpu_room(knobs: PolicyKnobs, loads: Loads) -> tuple[bool, str]:
    cpu = loads.cpu
    if not cpu.available:
        return False, "CPU engine unavailable"
    limit, name = cpu_batch_limit(knobs, loads)
    if cpu.running >= limit:
        return False, f"CPU running {cpu.running} >= {name} {limit}"
    itl = projected_itl_ms(cpu, loads.cpu_itl_slope_ms)
    if itl is not None and itl > knobs.cpu_decode_slo_ms:
        return False, f"CPU ITL would be {itl:.1f} ms > SLO {knobs.cpu_decode_slo_ms:g} ms"
    return True, "CPU within cpu_max_batch_size and its latency SLO"


def cpu_allowed(knobs: PolicyKnobs) -> bool:
    """Whether the policy lets the CPU engine serve or decode at all."""
    if knobs.mode == "gpu-only":
        return False
    if knobs.mode == "auto" and not knobs.enable_auto_pd_offload:
        return False
    return knobs.cpu_max_batch_size > 0 or knobs.mode == "cpu-only"


def decide(knobs: PolicyKnobs, loads: Loads) -> Decision:
    """Route a new request."""
    gpu, cpu = loads.gpu, loads.cpu
    if knobs.mode == "cpu-only":
        if cpu.available:
            return Decision(Route.CPU_ONLY, reason="mode cpu-only")
        return Decision(
            Route.REJECTED, reason="mode cpu-only and the CPU engine is down", status=503
        )
    if not gpu.available:
        if cpu_allowed(knobs) and cpu.available:
            return Decision(Route.CPU_ONLY, reason="GPU engine down", fallback=True)
        return Decision(Route.REJECTED, reason="GPU engine down", status=503)
    if not cpu_allowed(knobs):
        return Decision(Route.GPU_ONLY, reason=f"mode {knobs.mode}, CPU offload off")
    chunk = token_limit(knobs, cpu.throughput_tps)
    if knobs.mode == "forced-pd":
        if cpu.available:
            return Decision(Route.PD, token_limit=0, reason="mode forced-pd")
        return Decision(Route.GPU_ONLY, reason="forced-pd but CPU engine down", fallback=True)
    if knobs.algorithm == "syshax-threshold":
        return syshax_threshold(knobs, loads)
    return capacity(knobs, loads, chunk)


def syshax_threshold(knobs: PolicyKnobs, loads: Loads) -> Decision:
    """sysHAX's decider: offload on GPU concurrency or KV pressure, gated by CPU throughput."""
    gpu, cpu = loads.gpu, loads.cpu
    if gpu.running >= knobs.max_num_seqs:
        why = f"GPU running {gpu.running} reached max_num_seqs {knobs.max_num_seqs}"
    elif gpu.kv_usage_perc > knobs.gpu_cache_threshold:
        why = f"GPU KV usage {gpu.kv_usage_perc:.1f}% > {knobs.gpu_cache_threshold:g}%"
    else:
        return Decision(Route.GPU_ONLY, reason="GPU below max_num_seqs and cache threshold")
    if not cpu.available:
        return Decision(Route.GPU_ONLY, reason=f"{why}; CPU engine down", fallback=True)
    slow = cpu.throughput_tps < knobs.cpu_throughput_threshold
    if slow and cpu.running >= 1:
        return Decision(Route.REJECTED, reason=f"{why}; CPU busy and slow", status=429)
    # sysHAX caps the CPU at max_num_seqs; the documents' cpu_max_batch_size is the tighter cap.
    if not slow and cpu.running >= min(knobs.max_num_seqs, cpu_batch_limit(knobs, loads)[0]):
        return Decision(Route.REJECTED, reason=f"{why}; CPU at its batch limit", status=429)
    return Decision(
        Route.PD, token_limit=token_limit(knobs, cpu.throughput_tps), reason=f"{why}; PD offload"
    )


def capacity(knobs: PolicyKnobs, loads: Loads, chunk: int) -> Decision:
    """Capacity-aware: keep the GPU under its knee, offload while the CPU meets its SLO.

    Among devices with room, the one whose marginal decode throughput is higher takes the
    sequence; an unmeasured CPU is assumed to run exactly at its SLO, so an idle GPU wins.
    """
    gpu_ok, gpu_why = gpu_room(knobs, loads)
    cpu_ok, cpu_why = cpu_room(knobs, loads)
    if gpu_ok and cpu_ok:
        gpu_gain = marginal_tps(loads.gpu, loads.gpu_itl_slope_ms, unknown_itl_ms=1.0)
        cpu_gain = marginal_tps(loads.cpu, loads.cpu_itl_slope_ms, knobs.cpu_decode_slo_ms)
        if cpu_gain > gpu_gain:
            return Decision(
                Route.PD,
                token_limit=chunk,
                reason=f"CPU gains {cpu_gain:.0f} > GPU {gpu_gain:.0f} tok/s",
            )
        return Decision(Route.GPU_ONLY, reason=gpu_why)
    if gpu_ok:
        return Decision(Route.GPU_ONLY, reason=f"{gpu_why}; {cpu_why}")
    if cpu_ok:
        if loads.gpu.waiting > 0 and loads.gpu.kv_usage_perc >= knobs.gpu_cache_threshold:
            # The GPU cannot even admit a prefill: KV is full and requests queue.
            return Decision(Route.CPU_ONLY, reason=f"{gpu_why}; GPU queueing, CPU prefill")
        return Decision(Route.PD, token_limit=chunk, reason=f"{gpu_why}; offload decode")
    if loads.gpu.waiting < knobs.max_queue_size:
        return Decision(Route.GPU_ONLY, reason=f"{gpu_why}; {cpu_why}; queued on GPU")
    return Decision(
        Route.REJECTED, reason=f"{gpu_why}; {cpu_why}; GPU queue at max_queue_size", status=429
    )


def decide_next_chunk(knobs: PolicyKnobs, loads: Loads) -> Decision:
    """After a CPU chunk: keep decoding on the CPU (PD) or move the sequence to the GPU.

    ``loads.cpu`` must not count this sequence (its chunk just ended).
    """
    chunk = token_limit(knobs, loads.cpu.throughput_tps)
    if not loads.cpu.available:
        return Decision(Route.GPU_ONLY, reason="CPU engine down", fallback=True)
    pinned = knobs.mode in {"cpu-only", "forced-pd"} or knobs.algorithm == "syshax-threshold"
    if pinned or not loads.gpu.available:
        # sysHAX sends continuations straight back to the CPU.
        return Decision(Route.PD, token_limit=chunk, reason="continue on CPU")
    if not cpu_allowed(knobs):
        return Decision(Route.GPU_ONLY, reason=f"policy now {knobs.mode}, CPU offload off")
    gpu_ok, gpu_why = gpu_room(knobs, loads)
    if gpu_ok:
        cpu_ok, _cpu_why = cpu_room(knobs, loads)
        gpu_gain = marginal_tps(loads.gpu, loads.gpu_itl_slope_ms, unknown_itl_ms=1.0)
        cpu_gain = marginal_tps(loads.cpu, loads.cpu_itl_slope_ms, knobs.cpu_decode_slo_ms)
        if not cpu_ok or gpu_gain >= cpu_gain:
            return Decision(Route.GPU_ONLY, reason=f"back to GPU: {gpu_why}")
    return Decision(Route.PD, token_limit=chunk, reason="GPU still at its knee; stay on CPU")


def retry_after_seconds(knobs: PolicyKnobs) -> float:
    # One scrape interval is the soonest the router can see a changed load.
    return max(1.0, math.ceil(knobs.metrics_interval_seconds))
