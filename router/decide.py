"""The deciders: pure functions from (policy knobs, device loads) to a routing decision.

No I/O here. ``router.engines.backends`` builds the :class:`DeviceLoad` values from scraped
metrics and the router's own in-flight counts; ``router.request`` (a new request) and the PD
protocols (a chunk boundary) act on the :class:`Decision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from common.policy_schema import PolicyKnobs, SloClass
from router.engines.load import DeviceLoad


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
    # A short stable label of the reason, for the decisions metric (the reason has numbers).
    code: str = ""


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
# 0.9: live, a CPU within it met the target for every request it took (the A10 + Xeon
# decode-heavy matrix scenario at 80 ms), where 0.8 shut out a CPU that decodes within 79 %
# of the target alone (docs/decisions/0065-cpu-margins.md).
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


def gpu_saturation(knobs: PolicyKnobs, loads: Loads) -> tuple[str, str]:
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
        return "gpu-hot", f"GPU at {hot:g} C >= {knobs.gpu_max_temperature_c:g} C"
    if gpu.running >= knobs.max_num_seqs:
        return "gpu-max-seqs", f"GPU running {gpu.running} >= max_num_seqs {knobs.max_num_seqs}"
    cache = knobs.gpu_cache_threshold
    if gpu.kv_usage_perc >= cache:
        return "gpu-kv-full", f"GPU KV {gpu.kv_usage_perc:.1f}% >= {cache:g}%"
    if gpu.waiting > 0:
        return "gpu-queue", f"GPU has {gpu.waiting} requests waiting"
    knee = knobs.gpu_decode_slo_ms
    itl = projected_itl_ms(gpu, loads.gpu_itl_slope_ms, decode_steps=True)
    if itl is not None and itl > knee:
        return "gpu-knee", f"GPU decode step would be {itl:.1f} ms > knee {knee:g} ms"
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


def cpu_room(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None) -> tuple[str, str]:
    """Whether the CPU takes one more decode: ("", why) when it does, else the code of what
    refuses it and why. It must be freshly scraped, below its batch caps, and the resulting
    batch within ``CPU_SLO_MARGIN`` of the request's CPU latency target (``cpu_slo_ms``) by
    its measured latency. Never measured, it takes one probe sequence, and only for a class
    whose target is no tighter than ``cpu_decode_slo_ms`` (an interactive request is not
    the one to learn the CPU's latency on)."""
    cpu = loads.cpu
    if not cpu.available:
        return "cpu-down", "CPU engine unavailable"
    if cpu.stale:
        return "cpu-stale", "CPU engine's latest metrics scrape failed: its load is unknown"
    host = loads.host_memory_percent
    if host is not None and host >= knobs.cpu_max_memory_percent:
        return "host-memory", f"host memory {host:g}% >= {knobs.cpu_max_memory_percent:g}%"
    limit, name = cpu_batch_limit(knobs, loads)
    if cpu.running >= limit:
        return "cpu-full", f"CPU running {cpu.running} >= {name} {limit}"
    target = cpu_slo_ms(knobs, slo)
    slo_batch = cpu_slo_batch(knobs, loads, slo)
    if slo_batch is None:
        if target < knobs.cpu_decode_slo_ms:
            why = f"CPU not yet measured and the {target:g} ms target is too tight to probe it"
            return "cpu-unmeasured", why
        if cpu.running >= CPU_PROBE_BATCH:
            return "cpu-probing", f"CPU not yet measured, running its probe of {CPU_PROBE_BATCH}"
    elif cpu.running + 1 > slo_batch:
        itl = projected_itl_ms(cpu, loads.cpu_itl_slope_ms)
        shown = f"{itl:.1f}" if itl is not None else "?"
        why = f"CPU ITL would be {shown} ms > {CPU_SLO_MARGIN * target:g} ms (target {target:g} ms"
        return "cpu-would-miss", f"{why} with margin)"
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
    if knobs.mode == "gpu-only":
        return False
    if knobs.mode == "auto" and not knobs.enable_auto_pd_offload:
        return False
    return knobs.cpu_max_batch_size > 0 or knobs.mode == "cpu-only"


def decide(
    knobs: PolicyKnobs,
    loads: Loads,
    slo: SloClass | None = None,
    *,
    prompt_tokens: int | None = None,
) -> Decision:
    """Route a new request of SLO class ``slo`` (None: a request judged without a class)
    with a prompt of about ``prompt_tokens`` (None: unknown; no CPU prefill is estimated)."""
    gpu, cpu = loads.gpu, loads.cpu
    if knobs.mode == "cpu-only":
        if cpu.available:
            return Decision(Route.CPU_ONLY, reason="mode cpu-only", code="mode")
        return Decision(
            Route.REJECTED,
            reason="mode cpu-only and the CPU engine is down",
            status=503,
            code="cpu-down",
        )
    if not gpu.available:
        if cpu_allowed(knobs) and cpu.available:
            return Decision(
                Route.CPU_ONLY, reason="GPU engine down", fallback=True, code="gpu-down"
            )
        return Decision(Route.REJECTED, reason="GPU engine down", status=503, code="gpu-down")
    if not cpu_allowed(knobs):
        return Decision(
            Route.GPU_ONLY, reason=f"mode {knobs.mode}, CPU offload off", code="offload-off"
        )
    chunk = token_limit(knobs, cpu.throughput_tps)
    if knobs.mode == "forced-pd":
        if cpu.available:
            return Decision(Route.PD, token_limit=0, reason="mode forced-pd", code="mode")
        return Decision(
            Route.GPU_ONLY,
            reason="forced-pd but CPU engine down",
            fallback=True,
            code="cpu-down",
        )
    if knobs.algorithm == "syshax-threshold":
        return syshax_threshold(knobs, loads)
    return capacity(knobs, loads, chunk, slo, prompt_tokens)


def hold_to_limits(decision: Decision, knobs: PolicyKnobs, loads: Loads) -> Decision:
    """A route a request forced (``X-Syshax-Mode``), held to the operator's hard limits.

    A forced mode picks the device; it never puts a decode on a device past a limit the
    policy sets for it: a GPU at ``gpu_max_temperature_c``, or saturated with
    ``max_queue_size`` requests already waiting, takes no forced gpu-only request; a host at
    ``cpu_max_memory_percent``, or a CPU running its batch cap, takes no forced cpu-only or
    PD decode. Each is a 429, like the policy's own ``queue-full``. The batch cap counts the
    router's own sequences on the CPU, not the last scrape's: a benchmark runs at exactly its
    concurrency, and a scraped count that still holds the requests ended since the scrape
    would refuse requests the engine has room for. This is stricter than
    ``auto`` on a hot GPU on purpose: auto queues there only after the CPU had no room,
    while a forced request turned the CPU down. The latency SLOs are not limits here: a
    benchmark measures a device past them.
    """
    if decision.route is Route.GPU_ONLY and loads.gpu.available:
        hot = loads.gpu_temperature_c
        if hot is not None and hot >= knobs.gpu_max_temperature_c:
            why = f"GPU at {hot:g} C >= gpu_max_temperature_c {knobs.gpu_max_temperature_c:g} C"
            return _refused(knobs, why, "gpu-hot")
        code, why = gpu_saturation(knobs, loads)
        if code and loads.gpu.waiting >= knobs.max_queue_size:
            return _refused(knobs, f"{why}; GPU queue at max_queue_size", "queue-full")
    if decision.route in (Route.CPU_ONLY, Route.PD) and loads.cpu.available:
        host, most = loads.host_memory_percent, knobs.cpu_max_memory_percent
        if host is not None and host >= most:
            why = f"host memory {host:g}% >= cpu_max_memory_percent {most:g}%"
            return _refused(knobs, why, "host-memory")
        limit, name = cpu_batch_limit(knobs, loads)
        if loads.cpu_inflight >= limit:
            why = f"CPU running {loads.cpu_inflight} from this router >= {name} {limit}"
            return _refused(knobs, why, "cpu-full")
    return decision


def _refused(knobs: PolicyKnobs, why: str, code: str) -> Decision:
    return Decision(Route.REJECTED, reason=f"forced {knobs.mode}: {why}", status=429, code=code)


def syshax_threshold(knobs: PolicyKnobs, loads: Loads) -> Decision:
    """sysHAX's decider: offload on GPU concurrency or KV pressure, gated by CPU throughput."""
    gpu, cpu = loads.gpu, loads.cpu
    if gpu.running >= knobs.max_num_seqs:
        why, code = (
            f"GPU running {gpu.running} reached max_num_seqs {knobs.max_num_seqs}",
            "gpu-max-seqs",
        )
    elif gpu.kv_usage_perc > knobs.gpu_cache_threshold:
        why = f"GPU KV usage {gpu.kv_usage_perc:.1f}% > {knobs.gpu_cache_threshold:g}%"
        code = "gpu-kv-full"
    else:
        return Decision(
            Route.GPU_ONLY, reason="GPU below max_num_seqs and cache threshold", code="gpu-room"
        )
    if not cpu.available:
        return Decision(
            Route.GPU_ONLY, reason=f"{why}; CPU engine down", fallback=True, code="cpu-down"
        )
    slow = cpu.throughput_tps < knobs.cpu_throughput_threshold
    if slow and cpu.running >= 1:
        return Decision(
            Route.REJECTED, reason=f"{why}; CPU busy and slow", status=429, code="cpu-slow"
        )
    # sysHAX caps the CPU at max_num_seqs; the documents' cpu_max_batch_size is the tighter cap.
    if not slow and cpu.running >= min(knobs.max_num_seqs, cpu_batch_limit(knobs, loads)[0]):
        return Decision(
            Route.REJECTED, reason=f"{why}; CPU at its batch limit", status=429, code="cpu-full"
        )
    return Decision(
        Route.PD,
        token_limit=token_limit(knobs, cpu.throughput_tps),
        reason=f"{why}; PD offload",
        code=code,
    )


# What refuses a decode on the CPU, where it is the decision's own code rather than
# ``both-busy``: the CPU would miss the request's target, or its load is unknown.
CPU_REFUSAL_CODES = frozenset({"cpu-would-miss", "cpu-stale", "cpu-unmeasured"})


def capacity(
    knobs: PolicyKnobs,
    loads: Loads,
    chunk: int,
    slo: SloClass | None = None,
    prompt_tokens: int | None = None,
) -> Decision:
    """Capacity-aware: the GPU serves while it has room; past any of its limits the decode
    goes to the CPU only while the CPU's resulting batch meets the request's CPU latency
    target with ``CPU_SLO_MARGIN`` (and measured, when the only limit is the GPU's knee).

    A new request has the most tokens left of any sequence, so offloading it frees the most
    GPU KV for the queue. A GPU whose KV is full with requests already waiting for blocks
    cannot even prefill soon, so the request is served whole on the CPU, unless the CPU is
    measured to miss its TTFT target. With neither device able to serve it, the request
    waits in the GPU's queue up to ``max_queue_size`` (``cpu-would-miss`` where the CPU had
    the room but not the latency, ``cpu-stale`` where its load is unknown).

    A ``cpu_first`` class (with ``class_aware``) is routed by ``cpu_first_route`` first.
    """
    if cpu_first(knobs, slo):
        assert slo is not None
        first = cpu_first_route(knobs, loads, chunk, slo, prompt_tokens)
        if first is not None:
            return first
    code, gpu_why = gpu_saturation(knobs, loads)
    if not code:
        return Decision(Route.GPU_ONLY, reason=gpu_why, code="gpu-room")
    refusal, cpu_why = cpu_room(knobs, loads, slo)
    if not refusal and code == "gpu-knee" and loads.cpu.itl_ms is None:
        # The GPU is not full, only slower: probing an unknown CPU can only cost the request.
        refusal, cpu_why = "cpu-probing", "CPU not yet measured (an offload at the knee needs it)"
    if not refusal:
        if code == "gpu-kv-full" and loads.gpu.waiting > 0:
            # The GPU cannot even admit a prefill: its KV is full and requests already wait
            # for blocks. The request is served whole on the CPU rather than queue for a
            # TTFT, unless the CPU's own prefill is measured to miss the class's TTFT.
            ttft = cpu_ttft_ms(loads, prompt_tokens)
            target = slo.ttft_ms if slo is not None and knobs.class_aware else None
            if ttft is None or target is None or ttft <= CPU_TTFT_MARGIN * target:
                return Decision(
                    Route.CPU_ONLY,
                    reason=f"{gpu_why} and {loads.gpu.waiting} waiting; served on the CPU",
                    code="gpu-kv-blocked",
                )
        return Decision(Route.PD, token_limit=chunk, reason=f"{gpu_why}; offload decode", code=code)
    if loads.gpu.waiting < knobs.max_queue_size:
        held = refusal if refusal in CPU_REFUSAL_CODES else "both-busy"
        return Decision(Route.GPU_ONLY, reason=f"{gpu_why}; {cpu_why}; queued on GPU", code=held)
    return Decision(
        Route.REJECTED,
        reason=f"{gpu_why}; {cpu_why}; GPU queue at max_queue_size",
        status=429,
        code="queue-full",
    )


def cpu_first_route(
    knobs: PolicyKnobs, loads: Loads, chunk: int, slo: SloClass, prompt_tokens: int | None
) -> Decision | None:
    """A ``cpu_first`` class (batch): served whole on the CPU [``class-cpu-only``] whenever
    the CPU meets both its targets (its TPOT by ``cpu_room``, below the CPU's throughput
    knee; its TTFT by ``cpu_meets_ttft``), so its prefill does not queue on the GPU ahead of
    the classes that need the GPU. It reaches the GPU only while the GPU has clear spare
    room (``gpu_spare``: below every limit, nothing queued, its step within a margin of the
    knee): its prefill there with a CPU decode [``class-cpu-first``] when only the CPU's
    TTFT falls short, or wholly [``class-gpu-spare``; ``cpu-stale`` where the CPU's load is
    unknown]. Otherwise it waits in the router's queue [``class-wait``, a 429]. None (judge
    it as any request) with the CPU down or no queue to wait in (``max_queue_size`` 0).
    """
    refusal, why = cpu_room(knobs, loads, slo)
    gain = cpu_seat_gain(loads)
    if not refusal and gain is not None and gain < CPU_FIRST_MIN_GAIN:
        refusal = "cpu-knee"
        why = (
            f"CPU past its throughput knee: one more sequence adds {gain:.2f} of a "
            f"sequence's throughput < {CPU_FIRST_MIN_GAIN:g}"
        )
    spare, spare_why = gpu_spare(knobs, loads)
    if not refusal:
        ttft_ok, ttft_why = cpu_meets_ttft(loads, slo, prompt_tokens)
        if ttft_ok:
            reason = f"class {slo.name} served on the CPU: {why}; {ttft_why}"
            return Decision(Route.CPU_ONLY, reason=reason, code="class-cpu-only")
        # Where the CPU's TTFT cannot be estimated, the prefill takes the GPU as before this
        # rule (a wait for a measurement that may not come would starve the class); where it
        # is estimated to miss, only a GPU with clear spare room takes the prefill.
        unknown = cpu_ttft_ms(loads, prompt_tokens) is None
        if spare or unknown:
            reason = f"class {slo.name} decodes on the CPU first: {why}; {ttft_why}; {spare_why}"
            return Decision(Route.PD, token_limit=chunk, reason=reason, code="class-cpu-first")
        why = f"{why}; {ttft_why}"
    if not loads.cpu.available or knobs.max_queue_size <= 0:
        return None
    # A probe under way measures the CPU by the next scrape: the class waits for that
    # rather than take a GPU seat for its whole decode.
    if spare and refusal != "cpu-probing":
        code = "cpu-stale" if refusal == "cpu-stale" else "class-gpu-spare"
        return Decision(Route.GPU_ONLY, reason=f"{why}; {spare_why}", code=code)
    return Decision(
        Route.REJECTED,
        reason=f"class {slo.name} waits for the CPU: {why}; {spare_why}",
        status=429,
        code="class-wait",
    )


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


def decide_next_chunk(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None) -> Decision:
    """After a CPU chunk: keep decoding on the CPU (PD) or move the sequence to the GPU.

    ``loads.cpu`` must not count this sequence (its chunk just ended). Under the capacity
    algorithm the move costs the GPU a prefill of the whole context (no KV goes back), which
    delays every other sequence on a busy GPU and measured worse than staying there
    (docs/benchmarks.md, "Goodput at SLO"). So a sequence the CPU still serves within its
    class's target (``cpu_keeps``) moves back only to an idle GPU [``back``], and a
    ``cpu_first`` class (with ``class_aware``) not even then [``stay``]. A sequence the CPU no
    longer serves within its target (slower, or its scrape failed) moves back whenever the
    GPU can take it [``back-cpu-slow``, ``cpu-stale``]: below every GPU limit, and for a
    ``cpu_first`` class with clear spare room (``gpu_spare``); the one prefill costs the
    GPU less than every later token of this sequence late. Otherwise it stays.
    """
    chunk = token_limit(knobs, loads.cpu.throughput_tps)
    if not loads.cpu.available:
        return Decision(Route.GPU_ONLY, reason="CPU engine down", fallback=True, code="cpu-down")
    pinned = knobs.mode in {"cpu-only", "forced-pd"} or knobs.algorithm == "syshax-threshold"
    if pinned or not loads.gpu.available:
        # sysHAX sends continuations straight back to the CPU.
        return Decision(Route.PD, token_limit=chunk, reason="continue on CPU", code="stay")
    if not cpu_allowed(knobs):
        return Decision(
            Route.GPU_ONLY,
            reason=f"policy now {knobs.mode}, CPU offload off",
            code="offload-off",
        )
    keeps, keep_why = cpu_keeps(knobs, loads, slo)
    first = cpu_first(knobs, slo)
    if not keeps:
        if first:
            takes, gpu_why = gpu_spare(knobs, loads)
        else:
            saturated, gpu_why = gpu_saturation(knobs, loads)
            takes = not saturated
        if takes:
            code = "cpu-stale" if loads.cpu.stale else "back-cpu-slow"
            return Decision(Route.GPU_ONLY, reason=f"{keep_why}; {gpu_why}", code=code)
        reason = f"stay on CPU: {keep_why}; {gpu_why}"
        return Decision(Route.PD, token_limit=chunk, reason=reason, code="stay")
    if first:
        assert slo is not None
        return Decision(
            Route.PD, token_limit=chunk, reason=f"class {slo.name} stays on the CPU", code="stay"
        )
    gpu = loads.gpu
    if gpu.running == 0 and gpu.waiting == 0 and not gpu_saturation(knobs, loads)[0]:
        # An idle GPU delays nobody by recomputing this context, and decodes it faster.
        return Decision(Route.GPU_ONLY, reason="back to the idle GPU", code="back")
    return Decision(Route.PD, token_limit=chunk, reason="stay on CPU", code="stay")


def retry_after_seconds(knobs: PolicyKnobs) -> float:
    # One scrape interval is the soonest the router can see a changed load.
    return max(1.0, math.ceil(knobs.metrics_interval_seconds))
