"""Every offload judged against the request's class (docs/router.md, "The deciders";
docs/decisions/0058-offloads-judged-by-class.md): whatever saturated the GPU, a decode goes
to (or stays on) the CPU only where the CPU's projected token latency meets the class's TPOT
target with ``CPU_SLO_MARGIN``; batch is served wholly on the CPU when the CPU meets both
its targets; an unmeasured CPU takes one probe; a CPU whose scrape failed takes nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.policy_schema import PolicyKnobs
from router.decide import (
    CPU_SLO_MARGIN,
    Loads,
    Route,
    cpu_ttft_ms,
    decide,
    decide_next_chunk,
)
from router.engines.backends import Backend, Timeouts
from router.engines.load import DeviceLoad, LoadTracker, parse_metrics_text
from router.metrics import RouterMetrics

KNOBS = PolicyKnobs()
INTERACTIVE = KNOBS.slo_class("interactive")
STANDARD = KNOBS.slo_class("standard")
BATCH = KNOBS.slo_class("batch")
IDLE_GPU = DeviceLoad(True, 0, 0, 5.0, 0.0, None)
IDLE_CPU = DeviceLoad(True, 0, 0, 0.0, 0.0, None)
# A GPU with requests in its own queue: saturated.
QUEUED_GPU = replace(IDLE_GPU, running=20, waiting=2)
# A GPU running sequences well below every limit: it can take one more, but it is not idle.
ROOMY_GPU = replace(IDLE_GPU, running=5, itl_ms=15.0, decode_itl_ms=15.0, itl_batch=5.0)


def cpu(itl_ms: float | None, running: int = 1, **kw: object) -> DeviceLoad:
    """A CPU engine measured at ``itl_ms`` a token with ``running`` sequences."""
    load = DeviceLoad(True, running, 0, 0.0, 8.0, itl_ms, itl_batch=float(running))
    return replace(load, **kw)  # type: ignore[arg-type]


def saturations() -> dict[str, DeviceLoad]:
    """A GPU past each of its limits, by the decision code it gives."""
    return {
        "gpu-queue": QUEUED_GPU,
        "gpu-max-seqs": replace(IDLE_GPU, running=KNOBS.max_num_seqs),
        "gpu-kv-full": replace(IDLE_GPU, running=30, kv_usage_perc=95.0),
        "gpu-knee": replace(IDLE_GPU, running=30, decode_itl_ms=60.0, itl_ms=60.0),
    }


def test_the_a100_kunpeng_case_stays_on_the_gpu_with_its_own_code() -> None:
    """Issue 38: 1,024-token prompts, TPOT target 120 ms; the GPU queues and the Kunpeng
    decodes at 145 ms a token. Before, these went PD (gpu-queue) and all missed."""
    knobs = replace(KNOBS, cpu_decode_slo_ms=120.0)
    slo = knobs.slo_class("standard")
    kunpeng = cpu(145.0, running=1)
    d = decide(knobs, Loads(QUEUED_GPU, kunpeng), slo, prompt_tokens=1024)
    assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-would-miss")
    assert "target 120 ms" in d.reason
    # Not both-busy: that code stays for a CPU with no room (its batch caps).
    full = cpu(20.0, running=KNOBS.cpu_max_batch_size)
    assert decide(knobs, Loads(QUEUED_GPU, full), slo).code == "both-busy"


@pytest.mark.parametrize("reason", sorted(saturations()))
def test_every_offload_reason_needs_the_cpu_within_the_target_with_margin(reason: str) -> None:
    gpu = saturations()[reason]
    target = STANDARD.tpot_ms
    # One more sequence: base + 5 % slope. Within the margin: offloaded for that reason.
    meets = cpu(0.75 * target, running=1)
    d = decide(KNOBS, Loads(gpu, meets), STANDARD)
    assert (d.route, d.code) == (Route.PD, reason)
    # Within the target but not its margin: kept on the GPU.
    close = cpu(0.9 * target, running=1)
    d = decide(KNOBS, Loads(gpu, close), STANDARD)
    assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-would-miss")


def test_a_gpu_that_cannot_prefill_still_keeps_a_request_off_a_cpu_that_would_miss() -> None:
    blocked = replace(IDLE_GPU, running=5, waiting=4, kv_usage_perc=99.0)
    assert decide(KNOBS, Loads(blocked, cpu(40.0)), STANDARD).code == "gpu-kv-blocked"
    d = decide(KNOBS, Loads(blocked, cpu(95.0)), STANDARD)
    assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-would-miss")
    # A CPU measured to miss the class's TTFT (50 ms a prompt token x 1024 > 0.8 x 3 s)
    # prefills nothing: the decode still goes there, the prefill queues on the GPU.
    slow_prefill = cpu(40.0, prefill_ms_per_token=50.0)
    d = decide(KNOBS, Loads(blocked, slow_prefill), STANDARD, prompt_tokens=1024)
    assert (d.route, d.code) == (Route.PD, "gpu-kv-full")


def test_interactive_never_goes_to_a_cpu_that_misses_its_tpot() -> None:
    limit = CPU_SLO_MARGIN * INTERACTIVE.tpot_ms  # 45 ms
    for reason, gpu in saturations().items():
        ok = decide(KNOBS, Loads(gpu, cpu(limit - 5.0)), INTERACTIVE)
        assert ok.route is Route.PD, reason
        for itl in (limit + 1.0, INTERACTIVE.tpot_ms + 10.0):
            d = decide(KNOBS, Loads(gpu, cpu(itl)), INTERACTIVE)
            assert d.route is Route.GPU_ONLY, (reason, itl)
    # Never whole on the CPU either, however idle the CPU and full the GPU.
    blocked = replace(IDLE_GPU, running=5, waiting=4, kv_usage_perc=99.0)
    d = decide(KNOBS, Loads(blocked, cpu(60.0)), INTERACTIVE, prompt_tokens=16)
    assert d.route is Route.GPU_ONLY
    # A CPU never measured is not probed with an interactive request.
    d = decide(KNOBS, Loads(QUEUED_GPU, IDLE_CPU), INTERACTIVE)
    assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-unmeasured")


def test_an_unmeasured_cpu_takes_exactly_one_probe_request() -> None:
    first = decide(KNOBS, Loads(QUEUED_GPU, IDLE_CPU), STANDARD)
    assert (first.route, first.code) == (Route.PD, "gpu-queue")
    # The router counts its own sequence at once (running = max(scraped, in flight)).
    second = decide(KNOBS, Loads(QUEUED_GPU, cpu(None, running=1)), STANDARD)
    assert (second.route, second.code) == (Route.GPU_ONLY, "both-busy")
    assert "probe of 1" in second.reason
    # Batch likewise: an idle, never-measured CPU serves one batch request whole.
    probe = decide(KNOBS, Loads(IDLE_GPU, IDLE_CPU), BATCH, prompt_tokens=512)
    assert (probe.route, probe.code) == (Route.CPU_ONLY, "class-cpu-only")
    assert decide(KNOBS, Loads(IDLE_GPU, cpu(None)), BATCH, prompt_tokens=512).route is not (
        Route.CPU_ONLY
    )


def test_batch_is_served_wholly_on_the_cpu_that_meets_its_ttft_and_tpot() -> None:
    # 150 ms a token (< 0.8 x 300), 20 ms a prompt token: 1,024 tokens in about 20 s.
    kunpeng = cpu(150.0, running=4, prefill_ms_per_token=20.0)
    assert cpu_ttft_ms(Loads(IDLE_GPU, kunpeng), 1024) == pytest.approx(20480.0)
    for gpu in (IDLE_GPU, QUEUED_GPU):
        d = decide(KNOBS, Loads(gpu, kunpeng), BATCH, prompt_tokens=1024)
        assert (d.route, d.code) == (Route.CPU_ONLY, "class-cpu-only")
    # Requests queued on the CPU count as long as this one: 3 x 20 s > 0.8 x 60 s.
    queued = replace(kunpeng, waiting=2)
    d = decide(KNOBS, Loads(IDLE_GPU, queued), BATCH, prompt_tokens=1024)
    assert (d.route, d.code) == (Route.PD, "class-cpu-first")  # prefill on the spare GPU
    d = decide(KNOBS, Loads(QUEUED_GPU, queued), BATCH, prompt_tokens=1024)
    assert (d.route, d.code) == (Route.REJECTED, "class-wait")  # not ahead of the queue
    # A CPU that misses the batch TPOT serves no batch request, whole or decode.
    slow = cpu(290.0, running=4, prefill_ms_per_token=1.0)
    d = decide(KNOBS, Loads(IDLE_GPU, slow), BATCH, prompt_tokens=64)
    assert (d.route, d.code) == (Route.GPU_ONLY, "class-gpu-spare")


def test_batch_reaches_the_gpu_only_while_interactive_traffic_has_measured_room() -> None:
    full = cpu(20.0, running=KNOBS.cpu_max_batch_size, prefill_ms_per_token=1.0)
    assert decide(KNOBS, Loads(ROOMY_GPU, full), BATCH, prompt_tokens=64).code == (
        "class-gpu-spare"
    )
    # Anything queued on the GPU, or a GPU never measured that runs something: it waits.
    for gpu in (replace(ROOMY_GPU, waiting=1), replace(IDLE_GPU, running=1)):
        d = decide(KNOBS, Loads(gpu, full), BATCH, prompt_tokens=64)
        assert (d.route, d.code) == (Route.REJECTED, "class-wait"), gpu


def test_a_cpu_whose_scrape_failed_takes_no_new_decode_and_it_is_counted() -> None:
    stale = cpu(20.0, stale=True, prefill_ms_per_token=1.0)
    d = decide(KNOBS, Loads(QUEUED_GPU, stale), STANDARD)
    assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-stale")
    d = decide(KNOBS, Loads(IDLE_GPU, stale), BATCH, prompt_tokens=64)
    assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-stale")
    metrics = RouterMetrics()
    metrics.decision("new", d.route.value, d.code)
    labels = {"stage": "new", "route": "gpu-only", "reason": "cpu-stale"}
    assert metrics.registry.get_sample_value("syshax_router_decisions_total", labels) == 1.0
    # At a chunk boundary the sequence moves back to a GPU with room.
    chunk = decide_next_chunk(KNOBS, Loads(ROOMY_GPU, stale), STANDARD)
    assert (chunk.route, chunk.code) == (Route.GPU_ONLY, "cpu-stale")


def test_a_timed_out_scrape_marks_the_backends_load_stale() -> None:
    backend = Backend("http://cpu", "cpu", Timeouts())
    backend.scrape_succeeded(parse_metrics_text("vllm:num_requests_running 1\n", 10.0), 10.0, 10.0)
    assert not backend.load(10.5).stale
    backend.scrape_failed("timeout", "no answer within 2s", alive=True)
    assert backend.load(11.0).stale
    assert backend.load(100.0).stale  # past the sample's age: only the in-flight count left


def metrics_text(running: int, tokens: float, itl_sum: float, itl_count: float) -> str:
    return (
        f"vllm:num_requests_running {running}\n"
        f"vllm:generation_tokens_total {tokens}\n"
        f"vllm:inter_token_latency_seconds_sum {itl_sum}\n"
        f"vllm:inter_token_latency_seconds_count {itl_count}\n"
    )


def test_a_cpu_whose_latency_jumps_loses_new_decodes_within_one_scrape() -> None:
    tracker = LoadTracker("cpu")
    tracker.observe(parse_metrics_text(metrics_text(2, 0, 0.0, 0), 0.0))
    tracker.observe(parse_metrics_text(metrics_text(2, 40, 2.4, 40), 1.0))  # 60 ms
    before = Loads(QUEUED_GPU, tracker.tracked_load(2), cpu_itl_slope_ms=tracker.itl_slope_ms)
    assert decide(KNOBS, before, STANDARD).route is Route.PD
    tracker.observe(parse_metrics_text(metrics_text(2, 54, 4.4, 54), 2.0))  # 143 ms
    after = Loads(QUEUED_GPU, tracker.tracked_load(2), cpu_itl_slope_ms=tracker.itl_slope_ms)
    assert decide(KNOBS, after, STANDARD).code == "cpu-would-miss"
    # The batch sequences it still serves within 300 ms stay at their chunk boundary.
    assert decide_next_chunk(KNOBS, after, BATCH).code == "stay"
    # A standard one it no longer serves within 100 ms moves back to the GPU with room.
    roomy = replace(after, gpu=ROOMY_GPU)
    assert decide_next_chunk(KNOBS, roomy, STANDARD).code == "back-cpu-slow"


def test_a_sequence_the_cpu_no_longer_serves_within_target_moves_back_when_the_gpu_can() -> None:
    # Past the target (110 > 100 ms): back to a GPU below its limits, busy or not.
    slow = cpu(105.0, running=2)
    d = decide_next_chunk(KNOBS, Loads(ROOMY_GPU, slow), STANDARD)
    assert (d.route, d.code) == (Route.GPU_ONLY, "back-cpu-slow")
    # A saturated GPU cannot take it (the recompute would queue): it stays.
    d = decide_next_chunk(KNOBS, Loads(QUEUED_GPU, slow), STANDARD)
    assert (d.route, d.code) == (Route.PD, "stay")
    assert "target 100 ms" in d.reason
    # Past the admission margin but within the target (90 ms): it stays; the move's recompute
    # is paid only on evidence of a miss.
    close = cpu(85.0, running=2)
    assert decide_next_chunk(KNOBS, Loads(ROOMY_GPU, close), STANDARD).code == "stay"
    # Batch past its target moves back only to a GPU with clear spare room.
    slow_batch = cpu(310.0, running=2)
    d = decide_next_chunk(KNOBS, Loads(ROOMY_GPU, slow_batch), BATCH)
    assert (d.route, d.code) == (Route.GPU_ONLY, "back-cpu-slow")
    near_knee = replace(ROOMY_GPU, decode_itl_ms=0.9 * KNOBS.gpu_decode_slo_ms)
    assert decide_next_chunk(KNOBS, Loads(near_knee, slow_batch), BATCH).code == "stay"


def test_the_cpu_prefill_time_is_measured_from_its_ttft_and_computed_prompt_tokens() -> None:
    def text(prompt: int, cached: int, ttft_sum: float, firsts: int) -> str:
        return (
            f"vllm:prompt_tokens_total {prompt}\n"
            f"vllm:prompt_tokens_cached_total {cached}\n"
            f"vllm:time_to_first_token_seconds_sum {ttft_sum}\n"
            f"vllm:time_to_first_token_seconds_count {firsts}\n"
        )

    tracker = LoadTracker("cpu")
    tracker.observe(parse_metrics_text(text(0, 0, 0.0, 0), 0.0))
    assert tracker.tracked_load(0).prefill_ms_per_token is None
    # Two prompts of 1,024 (one handed over: cached), 12.288 s of TTFT: 12 ms a computed token.
    tracker.observe(parse_metrics_text(text(2048, 1024, 12.288, 2), 1.0))
    assert tracker.tracked_load(0).prefill_ms_per_token == pytest.approx(12.0)
    # An interval of handed-over prompts only (a token recomputed each): the last stands.
    tracker.observe(parse_metrics_text(text(4096, 3070, 12.5, 4), 2.0))
    assert tracker.tracked_load(0).prefill_ms_per_token == pytest.approx(12.0)
