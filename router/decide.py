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


# Sequences an idle, never-measured CPU engine takes before its first ITL is scraped.
CPU_PROBE_BATCH = 4
# At the GPU's latency knee (it still has room) a decode moves only to a CPU measured to
# meet its latency SLO with this much to spare: the GPU would have served the request
# within its SLO, so the CPU must too, under its own noise (docs/router.md).
KNEE_CPU_MARGIN = 0.8
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
    """The largest CPU batch whose projected ITL stays within the request's CPU latency
    target (``cpu_slo_ms``), from the measured ITL and its slope against batch size; None
    when the CPU was never measured."""
    target = cpu_slo_ms(knobs, slo)
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


def cpu_room(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None) -> tuple[bool, str]:
    """Whether the CPU takes one more decode: below its batch caps, and the resulting batch
    within the request's CPU latency target (``cpu_slo_ms``) by the CPU's measured latency."""
    cpu = loads.cpu
    if not cpu.available:
        return False, "CPU engine unavailable"
    host = loads.host_memory_percent
    if host is not None and host >= knobs.cpu_max_memory_percent:
        return False, f"host memory {host:g}% >= {knobs.cpu_max_memory_percent:g}%"
    limit, name = cpu_batch_limit(knobs, loads)
    if cpu.running >= limit:
        return False, f"CPU running {cpu.running} >= {name} {limit}"
    slo_batch = cpu_slo_batch(knobs, loads, slo)
    if slo_batch is None:
        if cpu.running >= CPU_PROBE_BATCH:
            return False, f"CPU not yet measured, running its probe batch of {CPU_PROBE_BATCH}"
    elif cpu.running + 1 > slo_batch:
        itl = projected_itl_ms(cpu, loads.cpu_itl_slope_ms)
        shown = f"{itl:.1f}" if itl is not None else "?"
        return False, f"CPU ITL would be {shown} ms > SLO {cpu_slo_ms(knobs, slo):g} ms"
    return True, "CPU within its batch caps and its latency SLO"


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


def cpu_meets_with_margin(
    knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None
) -> tuple[bool, str]:
    """Whether the CPU, measured, would decode one more sequence within
    ``KNEE_CPU_MARGIN`` of the request's CPU latency target: the test for an offload the
    GPU's knee asks for, when the GPU itself still has room."""
    limit = KNEE_CPU_MARGIN * cpu_slo_ms(knobs, slo)
    itl = projected_itl_ms(loads.cpu, loads.cpu_itl_slope_ms)
    if itl is None:
        return False, "CPU not yet measured (an offload at the knee needs its latency)"
    if itl > limit:
        return False, f"CPU ITL would be {itl:.1f} ms > {limit:g} ms (SLO with margin)"
    return True, f"CPU ITL would be {itl:.1f} ms, within its SLO with margin"


def cpu_allowed(knobs: PolicyKnobs) -> bool:
    """Whether the policy lets the CPU engine serve or decode at all."""
    if knobs.mode == "gpu-only":
        return False
    if knobs.mode == "auto" and not knobs.enable_auto_pd_offload:
        return False
    return knobs.cpu_max_batch_size > 0 or knobs.mode == "cpu-only"


def decide(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None) -> Decision:
    """Route a new request of SLO class ``slo`` (None: a request judged without a class)."""
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
    return capacity(knobs, loads, chunk, slo)


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


def capacity(knobs: PolicyKnobs, loads: Loads, chunk: int, slo: SloClass | None = None) -> Decision:
    """Capacity-aware: the GPU serves while it has room; past any of its limits the decode
    goes to the CPU while the CPU's resulting batch meets its latency SLO (with a margin, and
    measured, when the only limit is the GPU's latency knee).

    A new request has the most tokens left of any sequence, so offloading it frees the most
    GPU KV for the queue. A GPU whose KV is full with requests already waiting for blocks
    cannot even prefill soon, so the request is served whole on the CPU. With neither device
    free, the request waits in the GPU's queue up to ``max_queue_size``.

    With ``class_aware`` the CPU is judged against the request's class: its TPOT target
    replaces ``cpu_decode_slo_ms``, and a ``cpu_first`` class (batch) decodes on the CPU
    whenever the CPU meets that target, even while the GPU has room, keeping the GPU for the
    classes that need it. When the CPU is up but has no room for it, such a request takes
    the GPU only while the GPU has clear spare room (``gpu_spare``); otherwise it is refused
    with a 429 (``class-wait``), so it waits in the router's queue for the CPU. Where there
    is no queue to wait in (``max_queue_size`` 0) it is judged as any other request.
    """
    if cpu_first(knobs, slo):
        assert slo is not None
        first_ok, first_why = cpu_room(knobs, loads, slo)
        gain = cpu_seat_gain(loads)
        if first_ok and gain is not None and gain < CPU_FIRST_MIN_GAIN:
            first_ok = False
            first_why = (
                f"CPU past its throughput knee: one more sequence adds {gain:.2f} of a "
                f"sequence's throughput < {CPU_FIRST_MIN_GAIN:g}"
            )
        if first_ok:
            return Decision(
                Route.PD,
                token_limit=chunk,
                reason=f"class {slo.name} decodes on the CPU first: {first_why}",
                code="class-cpu-first",
            )
        if loads.cpu.available and knobs.max_queue_size > 0:
            spare, spare_why = gpu_spare(knobs, loads)
            if spare:
                return Decision(
                    Route.GPU_ONLY,
                    reason=f"{first_why}; {spare_why}",
                    code="class-gpu-spare",
                )
            return Decision(
                Route.REJECTED,
                reason=f"class {slo.name} waits for the CPU: {first_why}; {spare_why}",
                status=429,
                code="class-wait",
            )
    code, gpu_why = gpu_saturation(knobs, loads)
    if not code:
        return Decision(Route.GPU_ONLY, reason=gpu_why, code="gpu-room")
    cpu_ok, cpu_why = cpu_room(knobs, loads, slo)
    if cpu_ok and code == "gpu-knee":
        # The GPU is not full, only slower: the move must not cost this request its SLO.
        cpu_ok, cpu_why = cpu_meets_with_margin(knobs, loads, slo)
    if cpu_ok:
        if code == "gpu-kv-full" and loads.gpu.waiting > 0:
            # The GPU cannot even admit a prefill: its KV is full and requests already wait
            # for blocks. The request is served whole on the CPU rather than queue for a TTFT.
            return Decision(
                Route.CPU_ONLY,
                reason=f"{gpu_why} and {loads.gpu.waiting} waiting; served on the CPU",
                code="gpu-kv-blocked",
            )
        return Decision(Route.PD, token_limit=chunk, reason=f"{gpu_why}; offload decode", code=code)
    if loads.gpu.waiting < knobs.max_queue_size:
        return Decision(
            Route.GPU_ONLY, reason=f"{gpu_why}; {cpu_why}; queued on GPU", code="both-busy"
        )
    return Decision(
        Route.REJECTED,
        reason=f"{gpu_why}; {cpu_why}; GPU queue at max_queue_size",
        status=429,
        code="queue-full",
    )


def decide_next_chunk(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None) -> Decision:
    """After a CPU chunk: keep decoding on the CPU (PD) or move the sequence to the GPU.

    ``loads.cpu`` must not count this sequence (its chunk just ended). Under the capacity
    algorithm a sequence moves back only to an idle GPU (nothing running or waiting): the move
    costs the GPU a prefill of the whole context (no KV goes back), which delays every other
    sequence on a busy GPU and measured worse than staying there (docs/benchmarks.md,
    "Goodput at SLO"). A ``cpu_first`` class (with ``class_aware``) stays on the CPU.
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
    if cpu_first(knobs, slo):
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
