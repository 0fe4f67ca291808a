"""The algorithms the pipeline's steps run: sysHAX's threshold decider, the capacity-aware
decider, the route of a class that decodes on the CPU first, and a forced mode held to the
policy's hard limits. Pure functions of the knobs and the loads (``router.decide.signals``).
"""

from __future__ import annotations

from common.decisions import Code, Route
from common.policy_schema import PolicyKnobs, SloClass
from router.decide.signals import (
    CPU_FIRST_MIN_GAIN,
    CPU_TTFT_MARGIN,
    Decision,
    Loads,
    cpu_batch_limit,
    cpu_meets_ttft,
    cpu_room,
    cpu_seat_gain,
    cpu_ttft_ms,
    gpu_saturation,
    gpu_spare,
    token_limit,
)


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
            return _refused(knobs, why, Code.GPU_HOT)
        code, why = gpu_saturation(knobs, loads)
        if code and loads.gpu.waiting >= knobs.max_queue_size:
            return _refused(knobs, f"{why}; GPU queue at max_queue_size", Code.QUEUE_FULL)
    if decision.route in (Route.CPU_ONLY, Route.PD) and loads.cpu.available:
        host, most = loads.host_memory_percent, knobs.cpu_max_memory_percent
        if host is not None and host >= most:
            why = f"host memory {host:g}% >= cpu_max_memory_percent {most:g}%"
            return _refused(knobs, why, Code.HOST_MEMORY)
        limit, name = cpu_batch_limit(knobs, loads)
        if loads.cpu_inflight >= limit:
            why = f"CPU running {loads.cpu_inflight} from this router >= {name} {limit}"
            return _refused(knobs, why, Code.CPU_FULL)
    return decision


def _refused(knobs: PolicyKnobs, why: str, code: Code) -> Decision:
    return Decision(Route.REJECTED, reason=f"forced {knobs.mode}: {why}", status=429, code=code)


def syshax_threshold(knobs: PolicyKnobs, loads: Loads) -> Decision:
    """sysHAX's decider: offload on GPU concurrency or KV pressure, gated by CPU throughput."""
    gpu, cpu = loads.gpu, loads.cpu
    if gpu.running >= knobs.max_num_seqs:
        why, code = (
            f"GPU running {gpu.running} reached max_num_seqs {knobs.max_num_seqs}",
            Code.GPU_MAX_SEQS,
        )
    elif gpu.kv_usage_perc > knobs.gpu_cache_threshold:
        why = f"GPU KV usage {gpu.kv_usage_perc:.1f}% > {knobs.gpu_cache_threshold:g}%"
        code = Code.GPU_KV_FULL
    else:
        return Decision(
            Route.GPU_ONLY, reason="GPU below max_num_seqs and cache threshold", code=Code.GPU_ROOM
        )
    if not cpu.available:
        return Decision(
            Route.GPU_ONLY, reason=f"{why}; CPU engine down", fallback=True, code=Code.CPU_DOWN
        )
    slow = cpu.throughput_tps < knobs.cpu_throughput_threshold
    if slow and cpu.running >= 1:
        return Decision(
            Route.REJECTED, reason=f"{why}; CPU busy and slow", status=429, code=Code.CPU_SLOW
        )
    # sysHAX caps the CPU at max_num_seqs; the documents' cpu_max_batch_size is the tighter cap.
    if not slow and cpu.running >= min(knobs.max_num_seqs, cpu_batch_limit(knobs, loads)[0]):
        return Decision(
            Route.REJECTED, reason=f"{why}; CPU at its batch limit", status=429, code=Code.CPU_FULL
        )
    return Decision(
        Route.PD,
        token_limit=token_limit(knobs, cpu.throughput_tps),
        reason=f"{why}; PD offload",
        code=code,
    )


# What refuses a decode on the CPU, where it is the decision's own code rather than
# ``both-busy``: the CPU would miss the request's target, or its load is unknown.
CPU_REFUSAL_CODES = frozenset({Code.CPU_WOULD_MISS, Code.CPU_STALE, Code.CPU_UNMEASURED})


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

    A ``cpu_first`` class (with ``class_aware``) reaches it only where ``cpu_first_route``,
    the step before, left it to be judged as any request.
    """
    code, gpu_why = gpu_saturation(knobs, loads)
    if not code:
        return Decision(Route.GPU_ONLY, reason=gpu_why, code=Code.GPU_ROOM)
    refusal, cpu_why = cpu_room(knobs, loads, slo)
    if not refusal and code == Code.GPU_KNEE and loads.cpu.itl_ms is None:
        # The GPU is not full, only slower: probing an unknown CPU can only cost the request.
        refusal, cpu_why = (
            Code.CPU_PROBING,
            "CPU not yet measured (an offload at the knee needs it)",
        )
    if not refusal:
        if code == Code.GPU_KV_FULL and loads.gpu.waiting > 0:
            # The GPU cannot even admit a prefill: its KV is full and requests already wait
            # for blocks. The request is served whole on the CPU rather than queue for a
            # TTFT, unless the CPU's own prefill is measured to miss the class's TTFT.
            ttft = cpu_ttft_ms(loads, prompt_tokens)
            target = slo.ttft_ms if slo is not None and knobs.class_aware else None
            if ttft is None or target is None or ttft <= CPU_TTFT_MARGIN * target:
                return Decision(
                    Route.CPU_ONLY,
                    reason=f"{gpu_why} and {loads.gpu.waiting} waiting; served on the CPU",
                    code=Code.GPU_KV_BLOCKED,
                )
        return Decision(Route.PD, token_limit=chunk, reason=f"{gpu_why}; offload decode", code=code)
    if loads.gpu.waiting < knobs.max_queue_size:
        held = refusal if refusal in CPU_REFUSAL_CODES else Code.BOTH_BUSY
        return Decision(Route.GPU_ONLY, reason=f"{gpu_why}; {cpu_why}; queued on GPU", code=held)
    return Decision(
        Route.REJECTED,
        reason=f"{gpu_why}; {cpu_why}; GPU queue at max_queue_size",
        status=429,
        code=Code.QUEUE_FULL,
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
        refusal = Code.CPU_KNEE
        why = (
            f"CPU past its throughput knee: one more sequence adds {gain:.2f} of a "
            f"sequence's throughput < {CPU_FIRST_MIN_GAIN:g}"
        )
    spare, spare_why = gpu_spare(knobs, loads)
    if not refusal:
        ttft_ok, ttft_why = cpu_meets_ttft(loads, slo, prompt_tokens)
        if ttft_ok:
            reason = f"class {slo.name} served on the CPU: {why}; {ttft_why}"
            return Decision(Route.CPU_ONLY, reason=reason, code=Code.CLASS_CPU_ONLY)
        # Where the CPU's TTFT cannot be estimated, the prefill takes the GPU as before this
        # rule (a wait for a measurement that may not come would starve the class); where it
        # is estimated to miss, only a GPU with clear spare room takes the prefill.
        unknown = cpu_ttft_ms(loads, prompt_tokens) is None
        if spare or unknown:
            reason = f"class {slo.name} decodes on the CPU first: {why}; {ttft_why}; {spare_why}"
            return Decision(Route.PD, token_limit=chunk, reason=reason, code=Code.CLASS_CPU_FIRST)
        why = f"{why}; {ttft_why}"
    if not loads.cpu.available or knobs.max_queue_size <= 0:
        return None
    # A probe under way measures the CPU by the next scrape: the class waits for that
    # rather than take a GPU seat for its whole decode.
    if spare and refusal != Code.CPU_PROBING:
        code = Code.CPU_STALE if refusal == Code.CPU_STALE else Code.CLASS_GPU_SPARE
        return Decision(Route.GPU_ONLY, reason=f"{why}; {spare_why}", code=code)
    return Decision(
        Route.REJECTED,
        reason=f"class {slo.name} waits for the CPU: {why}; {spare_why}",
        status=429,
        code=Code.CLASS_WAIT,
    )
