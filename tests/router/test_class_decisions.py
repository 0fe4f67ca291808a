"""Class-aware decisions (router/decide.py with a request's SLO class): the CPU is judged
against the request's own TPOT target, a batch decode goes to the CPU whenever it meets the
batch target and otherwise takes the GPU only while it has clear spare room (else it waits:
a 429 ``class-wait``), and with ``class_aware`` off every class is judged as before."""

from __future__ import annotations

from dataclasses import replace

from common.policy_schema import PolicyKnobs
from router.decide import (
    CPU_FIRST_MIN_GAIN,
    GPU_SPARE_MARGIN,
    Loads,
    Route,
    cpu_seat_gain,
    decide,
    decide_next_chunk,
)
from router.engines.load import DeviceLoad

IDLE_GPU = DeviceLoad(True, 0, 0, 5.0, 0.0, None)
# The GPU is saturated: requests wait in its own queue.
BUSY_GPU = replace(IDLE_GPU, running=20, waiting=2)
KNOBS = PolicyKnobs()
INTERACTIVE = KNOBS.slo_class("interactive")
STANDARD = KNOBS.slo_class("standard")
BATCH = KNOBS.slo_class("batch")


def cpu(itl_ms: float, running: int = 2, prefill_ms_per_token: float | None = None) -> DeviceLoad:
    """A CPU engine measured at ``itl_ms`` a token with ``running`` sequences (and, where
    given, its time to first token per prompt token)."""
    return DeviceLoad(
        True,
        running,
        0,
        0.0,
        40.0,
        itl_ms,
        itl_batch=float(running),
        prefill_ms_per_token=prefill_ms_per_token,
    )


def loads(gpu: DeviceLoad, cpu_load: DeviceLoad) -> Loads:
    # 2 ms more a token per extra CPU sequence.
    return Loads(gpu, cpu_load, cpu_itl_slope_ms=2.0)


def test_batch_decodes_on_the_cpu_with_the_gpu_idle_when_the_cpu_meets_its_tpot() -> None:
    d = decide(KNOBS, loads(IDLE_GPU, cpu(200.0)), BATCH)
    assert (d.route, d.code) == (Route.PD, "class-cpu-first")
    assert d.token_limit > 0
    # A CPU past the batch target (300 ms) leaves the batch request on the idle GPU.
    d = decide(KNOBS, loads(IDLE_GPU, cpu(320.0)), BATCH)
    assert (d.route, d.code) == (Route.GPU_ONLY, "class-gpu-spare")


def test_interactive_and_standard_stay_on_an_idle_gpu() -> None:
    for slo in (INTERACTIVE, STANDARD):
        d = decide(KNOBS, loads(IDLE_GPU, cpu(20.0)), slo)
        assert (d.route, d.code) == (Route.GPU_ONLY, "gpu-room"), slo.name


def test_interactive_goes_to_the_cpu_on_a_saturated_gpu_only_within_50_ms() -> None:
    # 40 ms at 2 sequences, +2 ms each: one more is 42 ms, within 50 with margin (45).
    d = decide(KNOBS, loads(BUSY_GPU, cpu(40.0)), INTERACTIVE)
    assert (d.route, d.code) == (Route.PD, "gpu-queue")
    # 46 ms meets 50 but not its margin; 62 ms misses it: the request queues on the GPU...
    for itl in (44.0, 60.0):
        d = decide(KNOBS, loads(BUSY_GPU, cpu(itl)), INTERACTIVE)
        assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-would-miss"), itl
        assert "target 50 ms" in d.reason
    # ...where a standard request (100 ms) and a batch one (300 ms) take that CPU.
    assert decide(KNOBS, loads(BUSY_GPU, cpu(60.0)), STANDARD).route is Route.PD
    measured = cpu(60.0, prefill_ms_per_token=5.0)
    d = decide(KNOBS, loads(BUSY_GPU, measured), BATCH, prompt_tokens=1024)
    assert d.route is Route.CPU_ONLY


def test_class_aware_off_judges_every_class_by_cpu_decode_slo_ms() -> None:
    blind = replace(KNOBS, class_aware=False, cpu_decode_slo_ms=100.0)
    for slo in (INTERACTIVE, STANDARD, BATCH, None):
        # No CPU-first for batch: an idle GPU serves every class.
        d = decide(blind, loads(IDLE_GPU, cpu(60.0)), slo)
        assert (d.route, d.code) == (Route.GPU_ONLY, "gpu-room"), slo
        # On a saturated GPU, a 60 ms CPU meets cpu_decode_slo_ms for every class alike...
        d = decide(blind, loads(BUSY_GPU, cpu(60.0)), slo)
        assert (d.route, d.code) == (Route.PD, "gpu-queue"), slo
        # ...and a 150 ms one for none, batch included.
        d = decide(blind, loads(BUSY_GPU, cpu(150.0)), slo)
        assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-would-miss"), slo
    # The same loads, class-aware: batch takes the 150 ms CPU, interactive does not.
    slow = cpu(150.0, prefill_ms_per_token=5.0)
    assert decide(KNOBS, loads(BUSY_GPU, slow), BATCH, prompt_tokens=64).route is Route.CPU_ONLY
    assert decide(KNOBS, loads(BUSY_GPU, slow), INTERACTIVE).route is Route.GPU_ONLY


def test_a_batch_sequence_stays_on_the_cpu_when_the_gpu_goes_idle() -> None:
    chunk = decide_next_chunk(KNOBS, loads(IDLE_GPU, cpu(200.0)), BATCH)
    assert (chunk.route, chunk.code) == (Route.PD, "stay")
    # Other classes move back to an idle GPU, as before classes (at 200 ms a token, past
    # their targets, they would move back to any GPU with room).
    for slo in (INTERACTIVE, STANDARD, None):
        chunk = decide_next_chunk(KNOBS, loads(IDLE_GPU, cpu(20.0)), slo)
        assert (chunk.route, chunk.code) == (Route.GPU_ONLY, "back"), slo
    # Class-blind, batch moves back too.
    blind = replace(KNOBS, class_aware=False)
    assert decide_next_chunk(blind, loads(IDLE_GPU, cpu(200.0)), BATCH).route is Route.GPU_ONLY


def gpu_at(step_ms: float, running: int = 10, **kw: object) -> DeviceLoad:
    """A GPU measured at decode steps of ``step_ms`` with ``running`` sequences."""
    return replace(
        IDLE_GPU,
        running=running,
        itl_ms=step_ms,
        decode_itl_ms=step_ms,
        itl_batch=float(running),
        **kw,  # type: ignore[arg-type]
    )


def full_cpu() -> DeviceLoad:
    """A CPU at its batch cap (cpu_max_batch_size), well within every latency target."""
    return cpu(20.0, running=KNOBS.cpu_max_batch_size)


def test_batch_the_cpu_cannot_take_uses_the_gpu_only_with_clear_spare_room() -> None:
    knee = KNOBS.gpu_decode_slo_ms
    # Steps far below the knee (one more sequence: +2 ms, within the margin): the GPU.
    roomy = Loads(gpu_at(0.5 * knee), full_cpu(), gpu_itl_slope_ms=2.0)
    d = decide(KNOBS, roomy, BATCH)
    assert (d.route, d.code) == (Route.GPU_ONLY, "class-gpu-spare")
    # Below the knee but past its margin: the batch request waits for the CPU (a 429 the
    # router's flow control queues), where an interactive request takes the GPU.
    near = Loads(gpu_at(GPU_SPARE_MARGIN * knee + 1.0), full_cpu(), gpu_itl_slope_ms=0.0)
    d = decide(KNOBS, near, BATCH)
    assert (d.route, d.status, d.code) == (Route.REJECTED, 429, "class-wait")
    assert "knee with margin" in d.reason
    assert decide(KNOBS, near, INTERACTIVE).code == "gpu-room"
    # Anything waiting on the GPU, or a saturated one: the batch request waits too, where
    # before it queued on the GPU itself.
    d = decide(KNOBS, loads(BUSY_GPU, full_cpu()), BATCH)
    assert (d.route, d.code) == (Route.REJECTED, "class-wait")
    waiting = Loads(gpu_at(0.2 * knee, waiting=1), full_cpu())
    assert decide(KNOBS, waiting, BATCH).code == "class-wait"
    # A GPU never measured counts as spare only while it runs nothing.
    assert decide(KNOBS, loads(replace(IDLE_GPU, running=1), full_cpu()), BATCH).code == (
        "class-wait"
    )


def test_batch_is_judged_as_before_without_a_queue_or_a_cpu() -> None:
    # No queue to wait in (flow control off): judged as any request, so an idle GPU takes
    # it and a saturated one answers the usual queue-full.
    no_queue = replace(KNOBS, max_queue_size=0)
    d = decide(no_queue, loads(IDLE_GPU, full_cpu()), BATCH)
    assert (d.route, d.code) == (Route.GPU_ONLY, "gpu-room")
    d = decide(no_queue, loads(BUSY_GPU, full_cpu()), BATCH)
    assert (d.route, d.code) == (Route.REJECTED, "queue-full")
    # The CPU down: no waiting for it; the GPU serves batch.
    down = replace(full_cpu(), available=False)
    d = decide(KNOBS, loads(BUSY_GPU, down), BATCH)
    assert (d.route, d.code) == (Route.GPU_ONLY, "both-busy")
    # Class-blind, a batch request on a full CPU queues on the saturated GPU, as before.
    blind = replace(KNOBS, class_aware=False)
    assert decide(blind, loads(BUSY_GPU, full_cpu()), BATCH).code == "both-busy"


def test_batch_takes_no_cpu_seat_past_the_cpus_throughput_knee() -> None:
    seats = replace(KNOBS, cpu_max_batch_size=64)
    # Memory-bound: 20 sequences at 66 ms, +0.25 ms a sequence. One more adds nearly a
    # whole sequence's throughput: batch takes the seat.
    flat = Loads(IDLE_GPU, cpu(66.0, running=20), cpu_itl_slope_ms=0.25)
    gain = cpu_seat_gain(flat)
    assert gain is not None and gain > 0.9
    assert decide(seats, flat, BATCH).code == "class-cpu-first"
    # Compute-bound: 20 sequences at 91 ms, +4.5 ms a sequence (the step grows with the
    # batch): one more adds almost nothing, though it meets the batch target (300 ms).
    steep = Loads(BUSY_GPU, cpu(91.0, running=20), cpu_itl_slope_ms=4.5)
    gain = cpu_seat_gain(steep)
    assert gain is not None and gain < CPU_FIRST_MIN_GAIN
    d = decide(seats, steep, BATCH)
    assert (d.route, d.code) == (Route.REJECTED, "class-wait")
    assert "throughput knee" in d.reason
    # The knee is a batch rule: a standard request on the saturated GPU still takes the CPU
    # that meets its latency target with margin (0.8 x 150 ms).
    looser = replace(seats, cpu_decode_slo_ms=150.0)
    assert decide(looser, steep, looser.slo_class("standard")).route is Route.PD
    # Never measured: no knee known, the probe batch decides.
    assert cpu_seat_gain(Loads(IDLE_GPU, replace(cpu(0.0), itl_ms=None))) is None
