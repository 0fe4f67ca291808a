"""What the pipeline's steps read off the loads: pure functions of the policy knobs and the
engines' loads, each answering one question (is the GPU saturated, and by what; has the CPU
room; would it keep a sequence within its target), with its reason code and its reason.

No I/O here. ``router.engines.backends`` builds the :class:`DeviceLoad` values from scraped
metrics and the router's own in-flight counts; the steps (``router.decide.steps``) turn
these answers into a :class:`Decision`, in the order ``router.decide.pipeline`` lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from common.decisions import Code, Mode, Route
from common.policy_schema import PolicyKnobs, SloClass
from router.engines.load import DeviceLoad


@dataclass(frozen=True)
class Decision:
    """A step's verdict: the route, and why (``code`` for the metrics and the
    ``X-Syshax-Reason`` header, ``reason`` for people)."""

    route: Route
    # Tokens the CPU decodes before the scheduler decides again; 0 = decode to the end.
    token_limit: int = 0
    reason: str = ""
    # True when the policy's first choice was impossible (an engine down) and this is the
    # next best; counted in the fallbacks metric.
    fallback: bool = False
    # For REJECTED: 429 (saturated, retry soon) or 503 (no engine can serve).
    status: int = 0
    # A short stable label of the reason, for the decisions metric (the reason has numbers).
    code: Code | Literal[""] = ""


# Relative ITL growth per extra sequence when too few batch sizes were seen to fit a slope.
# Decode is memory-bandwidth bound, so one more sequence costs little until the knee.
DEFAULT_ITL_SLOPE_FRACTION = 0.05


def token_limit(knobs: PolicyKnobs, cpu_throughput_tps: float) -> int:
    """sysHAX's chunk size: multiplier x CPU throughput rounded to tens, clamped to [min, max]."""
    tokens = int(round(cpu_throughput_tps * knobs.token_limit_multiplier, -1))
    return min(max(tokens, knobs.token_limit_min), knobs.token_limit_max)


def projected_itl_ms(
    load: DeviceLoad, slope_ms: float | None, extra: int = 1, *, decode_steps: bool = False
) -> float | None:
    """ITL the device would have with ``extra`` more sequences than it runs now, or None if
    never measured: from its mean ITL, or with ``decode_steps`` from its median gap (a decode
    step's time) where the engine exports its ITL histogram.

    The ITL was measured at the scraped batch (``itl_batch``); sequences the router sent
    since that scrape (``running`` counts them) are projected along the slope too, so a burst
    of arrivals between two scrapes does not all see the same stale latency.
    """
    base = load.decode_itl_ms if decode_steps and load.decode_itl_ms is not None else load.itl_ms
    if base is None:
        return None
    slope = slope_ms if slope_ms is not None else base * DEFAULT_ITL_SLOPE_FRACTION
    since_scrape = max(0.0, load.running - load.itl_batch) if load.itl_batch is not None else 0.0
    return base + slope * (since_scrape + extra)


@dataclass(frozen=True)
class Loads:
    gpu: DeviceLoad
    cpu: DeviceLoad
    gpu_itl_slope_ms: float | None = None
    cpu_itl_slope_ms: float | None = None
    # The CPU engine's own --max-num-seqs (None: unknown); it admits no more than that.
    cpu_max_num_seqs: int | None = None
    # The node's readings from the agents' heartbeats, via the control plane (None: unknown).
    gpu_temperature_c: float | None = None
    host_memory_percent: float | None = None
    # Sequences this router has on the CPU engine now (exact: a scrape lags the ones that
    # ended since it); what the CPU batch cap of a forced request counts.
    cpu_inflight: int = 0


# Sequences a never-measured CPU engine takes before its first ITL is scraped. Until then
# every sequence there is a bet on the request's TPOT target (live, a Kunpeng socket at
# 145 ms a token lost all four of a probe of 4 at a 120 ms target); one sequence's first
# tokens measure it by the next scrape, so one is enough and bounds the loss to one.
CPU_PROBE_BATCH = 1
# Every offload, whatever saturated the GPU, goes only to a CPU whose projected token latency
# at the batch it would then run is within this share of the request's CPU latency target:
# a scraped mean ITL is noisy live, and a decode on the CPU lasts many scrapes. A sequence
# already on the CPU stays while it meets the target itself (no margin; docs/router.md).
# 0.9: live, the A10 + Xeon decode-heavy matrix scenario (80 ms) met its target for every
# request at its GPU knee, those the CPU decoded included, where 0.8 shut out a CPU that
# decodes within 79 % of the target alone (docs/decisions/0065-cpu-margins.md).
CPU_SLO_MARGIN = 0.9
# A CPU prefill's first token is estimated, not measured per request (the prompt from the
# body's bytes, the rate from the last prefills: ``cpu_ttft_ms``): it must land within this
# share of the class's TTFT target.
CPU_TTFT_MARGIN = 0.8
# A request of a ``cpu_first`` class (batch) that the CPU has no room for takes the GPU only
# while the GPU has clear spare room: its projected decode step within this fraction of the
# knee (and below every other GPU limit). Such a request decodes for a long time, and the
# GPU's room now is no promise for the minutes it stays; below this margin the GPU is far
# enough from its knee for the load of the classes that need it to grow first. Otherwise
# the request waits in the router's queue for the CPU (docs/slo-classes.md).
GPU_SPARE_MARGIN = 0.8
# A request of a ``cpu_first`` class takes a CPU seat only while one more sequence still
# adds at least this share of a sequence's throughput to the CPU (``cpu_seat_gain``): past
# the CPU's throughput knee (compute-bound) a seat serves the class no faster, and only
# lengthens every step, closing the CPU to the classes that need its latency.
CPU_FIRST_MIN_GAIN = 0.5


def cpu_batch_limit(knobs: PolicyKnobs, loads: Loads) -> tuple[int, str]:
    """The most sequences the CPU may decode at once, and the name of the limit that binds:
    the policy's ``cpu_max_batch_size``, capped by the engine's ``max_num_seqs``."""
    engine = loads.cpu_max_num_seqs
    if engine is not None and engine < knobs.cpu_max_batch_size:
        return engine, "the CPU engine's max_num_seqs"
    return knobs.cpu_max_batch_size, "cpu_max_batch_size"


def cpu_slo_ms(knobs: PolicyKnobs, slo: SloClass | None) -> float:
    """The token latency the CPU must meet for a request: its class's TPOT target when the
    policy is ``class_aware`` and the request has a class, else ``cpu_decode_slo_ms``."""
    if slo is not None and knobs.class_aware:
        return slo.tpot_ms
    return knobs.cpu_decode_slo_ms


def cpu_first(knobs: PolicyKnobs, slo: SloClass | None) -> bool:
    """Whether the request's class decodes on the CPU first (``<class>_cpu_first``)."""
    return slo is not None and knobs.class_aware and slo.cpu_first


def cpu_slo_batch(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None) -> int | None:
    """The largest CPU batch whose projected ITL stays within ``CPU_SLO_MARGIN`` of the
    request's CPU latency target (``cpu_slo_ms``), from the measured ITL and its slope
    against batch size; None when the CPU was never measured."""
    target = CPU_SLO_MARGIN * cpu_slo_ms(knobs, slo)
    cpu = loads.cpu
    if cpu.itl_ms is None:
        return None
    slope = loads.cpu_itl_slope_ms
    if slope is None:
        slope = cpu.itl_ms * DEFAULT_ITL_SLOPE_FRACTION
    batch = cpu.itl_batch if cpu.itl_batch is not None else float(cpu.running)
    if slope <= 0:
        # A flat slope: the SLO sets no batch limit while the ITL meets it (the caps bind).
        return 1_000_000 if cpu.itl_ms <= target else int(batch)
    return max(0, int(batch + (target - cpu.itl_ms) / slope))


def gpu_saturation(knobs: PolicyKnobs, loads: Loads) -> tuple[Code | Literal[""], str]:
    """Why the GPU is saturated: (code, reason), or ("", reason) when it has room.

    Saturated means one more sequence would not be served at the GPU's best: it runs
    ``max_num_seqs``, its KV cache is past ``gpu_cache_threshold``, requests wait in its
    queue, its decode steps would pass the knee ``gpu_decode_slo_ms``, or its node reports it
    at ``gpu_max_temperature_c``. The knee reads the decode steps' time (the median
    inter-token gap): a prefill step stretches a few gaps of every stream batched with it,
    which moves the mean ITL past the knee on a GPU that is nowhere near it, and no decode
    moved to the CPU makes that prefill shorter.
    """
    gpu = loads.gpu
    hot = loads.gpu_temperature_c
    if hot is not None and hot >= knobs.gpu_max_temperature_c:
        return Code.GPU_HOT, f"GPU at {hot:g} C >= {knobs.gpu_max_temperature_c:g} C"
    if gpu.running >= knobs.max_num_seqs:
        return Code.GPU_MAX_SEQS, f"GPU running {gpu.running} >= max_num_seqs {knobs.max_num_seqs}"
    cache = knobs.gpu_cache_threshold
    if gpu.kv_usage_perc >= cache:
        return Code.GPU_KV_FULL, f"GPU KV {gpu.kv_usage_perc:.1f}% >= {cache:g}%"
    if gpu.waiting > 0:
        return Code.GPU_QUEUE, f"GPU has {gpu.waiting} requests waiting"
    knee = knobs.gpu_decode_slo_ms
    itl = projected_itl_ms(gpu, loads.gpu_itl_slope_ms, decode_steps=True)
    if itl is not None and itl > knee:
        return Code.GPU_KNEE, f"GPU decode step would be {itl:.1f} ms > knee {knee:g} ms"
    return "", "GPU below its limits"


def gpu_spare(knobs: PolicyKnobs, loads: Loads) -> tuple[bool, str]:
    """Whether the GPU has clear spare room for one more sequence: below all its limits
    (``gpu_saturation``) and its projected decode step within ``GPU_SPARE_MARGIN`` of the
    knee; a GPU whose decode steps were never measured only while it runs nothing."""
    code, why = gpu_saturation(knobs, loads)
    if code:
        return False, why
    gpu = loads.gpu
    itl = projected_itl_ms(gpu, loads.gpu_itl_slope_ms, decode_steps=True)
    if itl is None:
        if gpu.running > 0:
            return False, f"GPU not yet measured and running {gpu.running}"
        return True, "GPU idle"
    limit = GPU_SPARE_MARGIN * knobs.gpu_decode_slo_ms
    if itl > limit:
        return False, f"GPU decode step would be {itl:.1f} ms > {limit:g} ms (knee with margin)"
    return True, f"GPU decode step would be {itl:.1f} ms, within its knee with margin"


def cpu_room(
    knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None
) -> tuple[Code | Literal[""], str]:
    """Whether the CPU takes one more decode: ("", why) when it does, else the code of what
    refuses it and why. It must be freshly scraped, below its batch caps, and the resulting
    batch within ``CPU_SLO_MARGIN`` of the request's CPU latency target (``cpu_slo_ms``) by
    its measured latency. Never measured, it takes one probe sequence, and only for a class
    whose target is no tighter than ``cpu_decode_slo_ms`` (an interactive request is not
    the one to learn the CPU's latency on)."""
    cpu = loads.cpu
    if not cpu.available:
        return Code.CPU_DOWN, "CPU engine unavailable"
    if cpu.stale:
        return Code.CPU_STALE, "CPU engine's latest metrics scrape failed: its load is unknown"
    host = loads.host_memory_percent
    if host is not None and host >= knobs.cpu_max_memory_percent:
        return Code.HOST_MEMORY, f"host memory {host:g}% >= {knobs.cpu_max_memory_percent:g}%"
    limit, name = cpu_batch_limit(knobs, loads)
    if cpu.running >= limit:
        return Code.CPU_FULL, f"CPU running {cpu.running} >= {name} {limit}"
    target = cpu_slo_ms(knobs, slo)
    slo_batch = cpu_slo_batch(knobs, loads, slo)
    if slo_batch is None:
        if target < knobs.cpu_decode_slo_ms:
            why = f"CPU not yet measured and the {target:g} ms target is too tight to probe it"
            return Code.CPU_UNMEASURED, why
        if cpu.running >= CPU_PROBE_BATCH:
            return Code.CPU_PROBING, f"CPU not yet measured, running its probe of {CPU_PROBE_BATCH}"
    elif cpu.running + 1 > slo_batch:
        itl = projected_itl_ms(cpu, loads.cpu_itl_slope_ms)
        shown = f"{itl:.1f}" if itl is not None else "?"
        why = f"CPU ITL would be {shown} ms > {CPU_SLO_MARGIN * target:g} ms (target {target:g} ms"
        return Code.CPU_WOULD_MISS, f"{why} with margin)"
    return "", "CPU within its batch caps and its latency target with margin"


def cpu_seat_gain(loads: Loads) -> float | None:
    """How many sequences' worth of throughput one more sequence adds to the CPU, by its
    measured ITL and the ITL's slope against batch size: ``(b + 1) * itl(b) / itl(b + 1) -
    b`` at its batch ``b`` now; 1 where decode is memory-bound (a step costs the same), 0
    where it is compute-bound (a step grows with the batch). None when never measured."""
    cpu = loads.cpu
    now = projected_itl_ms(cpu, loads.cpu_itl_slope_ms, extra=0)
    after = projected_itl_ms(cpu, loads.cpu_itl_slope_ms, extra=1)
    if now is None or after is None or after <= 0:
        return None
    batch = cpu.running
    return (batch + 1) * now / after - batch


def cpu_ttft_ms(loads: Loads, prompt_tokens: int | None) -> float | None:
    """The CPU's time to first token for a prompt of ``prompt_tokens``, conservatively: its
    measured TTFT per computed prompt token (queue and batched prefills included) times the
    prompt, once for the request and once more for each request waiting there (taken to be
    as long). None when either is unknown."""
    per_token = loads.cpu.prefill_ms_per_token
    if per_token is None or prompt_tokens is None:
        return None
    return per_token * prompt_tokens * (1 + loads.cpu.waiting)


def cpu_meets_ttft(loads: Loads, slo: SloClass, prompt_tokens: int | None) -> tuple[bool, str]:
    """Whether the CPU would give a request of class ``slo`` its first token within
    ``CPU_TTFT_MARGIN`` of the class's TTFT target (``cpu_ttft_ms``). A CPU whose prefill was
    never measured takes one request to measure it, while it runs and queues nothing."""
    cpu = loads.cpu
    if prompt_tokens is None:
        return False, "prompt length unknown"
    estimate = cpu_ttft_ms(loads, prompt_tokens)
    if estimate is None:
        if cpu.running == 0 and cpu.waiting == 0:
            return True, "CPU prefill not yet measured: the idle CPU takes one to measure it"
        return False, "CPU prefill not yet measured and the CPU is busy"
    limit = CPU_TTFT_MARGIN * slo.ttft_ms
    if estimate > limit:
        return False, f"CPU first token in about {estimate:.0f} ms > {limit:g} ms"
    return True, f"CPU first token in about {estimate:.0f} ms"


def cpu_allowed(knobs: PolicyKnobs) -> bool:
    """Whether the policy lets the CPU engine serve or decode at all."""
    if knobs.mode == Mode.GPU_ONLY:
        return False
    if knobs.mode == Mode.AUTO and not knobs.enable_auto_pd_offload:
        return False
    return knobs.cpu_max_batch_size > 0 or knobs.mode == Mode.CPU_ONLY


def cpu_keeps(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None) -> tuple[bool, str]:
    """Whether the CPU still serves a sequence it decodes within the request's CPU latency
    target: freshly scraped, and its projected ITL with the sequence back in the batch at or
    below the target itself. No margin (``CPU_SLO_MARGIN`` admits): moving back costs the GPU
    a prefill of the whole context, so a sequence moves on evidence of a miss, not on noise
    within the margin. A CPU never measured has given no such evidence."""
    if loads.cpu.stale:
        return False, "CPU engine's latest metrics scrape failed: its load is unknown"
    target = cpu_slo_ms(knobs, slo)
    itl = projected_itl_ms(loads.cpu, loads.cpu_itl_slope_ms)
    if itl is not None and itl > target:
        return False, f"CPU ITL would be {itl:.1f} ms > target {target:g} ms"
    return True, "CPU within the target"


def retry_after_seconds(knobs: PolicyKnobs) -> float:
    # One scrape interval is the soonest the router can see a changed load.
    return max(1.0, math.ceil(knobs.metrics_interval_seconds))
