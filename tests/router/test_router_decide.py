"""The deciders are pure: every route and every reason is pinned here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.policy_schema import PolicyKnobs
from router.decide import (
    CPU_PROBE_BATCH,
    CPU_SLO_MARGIN,
    Loads,
    Route,
    cpu_slo_batch,
    decide,
    decide_next_chunk,
    hold_to_limits,
    projected_itl_ms,
    token_limit,
)
from router.engines.load import UNAVAILABLE, DeviceLoad, fit_itl_slope

IDLE_GPU = DeviceLoad(True, 0, 0, 5.0, 0.0, None)
IDLE_CPU = DeviceLoad(True, 0, 0, 0.0, 0.0, None)


def knobs(**kw: object) -> PolicyKnobs:
    return replace(PolicyKnobs(), **kw)  # type: ignore[arg-type]


def test_token_limit_follows_syshax_rounding_and_clamps() -> None:
    k = knobs(token_limit_multiplier=4.0, token_limit_min=10, token_limit_max=100)
    assert token_limit(k, 0.0) == 10  # clamped up to min
    assert token_limit(k, 7.0) == 30  # 28 rounds to the nearest ten
    assert token_limit(k, 12.0) == 50  # 48 -> 50
    assert token_limit(k, 1000.0) == 100  # clamped down to max


def test_idle_gpu_serves_alone_under_both_algorithms() -> None:
    for algorithm in ("capacity", "syshax-threshold"):
        d = decide(knobs(algorithm=algorithm), Loads(IDLE_GPU, IDLE_CPU))
        assert d.route is Route.GPU_ONLY, (algorithm, d)


def test_threshold_offloads_at_max_num_seqs_with_syshax_chunk() -> None:
    gpu = replace(IDLE_GPU, running=4)
    cpu = replace(IDLE_CPU, throughput_tps=20.0)
    d = decide(knobs(algorithm="syshax-threshold", max_num_seqs=4), Loads(gpu, cpu))
    assert d.route is Route.PD
    assert d.token_limit == 80  # 20 tok/s x 4


def test_threshold_offloads_on_cache_pressure() -> None:
    gpu = replace(IDLE_GPU, kv_usage_perc=95.0)
    d = decide(knobs(algorithm="syshax-threshold"), Loads(gpu, IDLE_CPU))
    assert d.route is Route.PD
    assert "KV" in d.reason


def test_threshold_rejects_when_cpu_is_slow_and_busy() -> None:
    gpu = replace(IDLE_GPU, running=4)
    cpu = replace(IDLE_CPU, running=1, throughput_tps=2.0)
    d = decide(knobs(algorithm="syshax-threshold", max_num_seqs=4), Loads(gpu, cpu))
    assert d.route is Route.REJECTED and d.status == 429


def test_threshold_respects_cpu_max_batch_size() -> None:
    gpu = replace(IDLE_GPU, running=4)
    cpu = replace(IDLE_CPU, running=2, throughput_tps=50.0)
    k = knobs(algorithm="syshax-threshold", max_num_seqs=4, cpu_max_batch_size=2)
    assert decide(k, Loads(gpu, cpu)).route is Route.REJECTED


# A CPU measured at 60 ms a token: within 80 % of the default 100 ms CPU SLO.
MEASURED_CPU = replace(IDLE_CPU, running=1, itl_ms=60.0, itl_batch=1.0)


def test_capacity_offloads_past_the_gpu_latency_knee_to_a_cpu_with_margin() -> None:
    gpu = replace(IDLE_GPU, running=10, itl_ms=49.0)
    d = decide(knobs(gpu_decode_slo_ms=50.0), Loads(gpu, MEASURED_CPU, gpu_itl_slope_ms=2.0))
    assert d.route is Route.PD and d.code == "gpu-knee"
    assert "knee" in d.reason


def test_the_knee_sends_nothing_to_a_cpu_never_measured() -> None:
    """Where the GPU still has room, probing an unknown CPU can only cost the request."""
    gpu = replace(IDLE_GPU, running=10, itl_ms=49.0)
    d = decide(knobs(gpu_decode_slo_ms=50.0), Loads(gpu, IDLE_CPU, gpu_itl_slope_ms=2.0))
    assert d.route is Route.GPU_ONLY
    assert "CPU not yet measured" in d.reason
    # A GPU that is full (its queue) still probes the unknown CPU.
    queued = decide(knobs(), Loads(replace(gpu, waiting=2), IDLE_CPU))
    assert queued.route is Route.PD and queued.code == "gpu-queue"


def test_no_offload_goes_to_a_cpu_without_margin() -> None:
    """The CPU would meet its SLO (93 ms < 100) but not with the margin (90 ms): neither
    the knee nor a full GPU (its queue) sends it the decode."""
    gpu = replace(IDLE_GPU, running=10, itl_ms=49.0)
    cpu = replace(MEASURED_CPU, itl_ms=88.0)
    d = decide(
        knobs(gpu_decode_slo_ms=50.0), Loads(gpu, cpu, gpu_itl_slope_ms=2.0, cpu_itl_slope_ms=5.0)
    )
    assert (d.route, d.code) == (Route.GPU_ONLY, "cpu-would-miss")
    assert "90 ms (target 100 ms with margin)" in d.reason
    full = decide(
        knobs(gpu_decode_slo_ms=50.0), Loads(replace(gpu, waiting=1), cpu, cpu_itl_slope_ms=5.0)
    )
    assert (full.route, full.code) == (Route.GPU_ONLY, "cpu-would-miss")
    # Within the margin (85 + 5 = 90 ms), the full GPU offloads.
    within = Loads(replace(gpu, waiting=1), replace(cpu, itl_ms=85.0), cpu_itl_slope_ms=5.0)
    assert decide(knobs(gpu_decode_slo_ms=50.0), within).route is Route.PD


def test_the_knee_reads_decode_steps_not_the_mean_a_prefill_stretched() -> None:
    """17 ms decode steps, one 700 ms prefill in the scrape interval: the mean ITL is 62 ms
    (past the 50 ms knee), the median gap 17 ms. The GPU is nowhere near its knee."""
    gpu = replace(IDLE_GPU, running=10, itl_ms=62.0, itl_batch=10.0, decode_itl_ms=17.0)
    d = decide(knobs(gpu_decode_slo_ms=50.0), Loads(gpu, MEASURED_CPU, gpu_itl_slope_ms=0.5))
    assert d.route is Route.GPU_ONLY and d.code == "gpu-room"
    # Decode steps past the knee do count.
    slow = replace(gpu, decode_itl_ms=52.0)
    assert decide(knobs(gpu_decode_slo_ms=50.0), Loads(slow, MEASURED_CPU)).code == "gpu-knee"


def test_capacity_keeps_gpu_when_cpu_would_break_its_slo() -> None:
    gpu = replace(IDLE_GPU, running=10, itl_ms=60.0)
    cpu = replace(IDLE_CPU, running=3, itl_ms=99.0)
    d = decide(
        knobs(gpu_decode_slo_ms=50.0, cpu_decode_slo_ms=100.0),
        Loads(gpu, cpu, cpu_itl_slope_ms=5.0),
    )
    # Nobody has room; the GPU queue is short so the request queues on the GPU.
    assert d.route is Route.GPU_ONLY
    assert "queued" in d.reason


def test_capacity_rejects_when_everything_is_saturated() -> None:
    gpu = replace(IDLE_GPU, running=8, waiting=3)
    cpu = replace(IDLE_CPU, running=2)
    k = knobs(max_num_seqs=8, cpu_max_batch_size=2, max_queue_size=3)
    d = decide(k, Loads(gpu, cpu))
    assert d.route is Route.REJECTED and d.status == 429


def test_capacity_serves_on_the_cpu_when_the_gpu_cannot_admit_a_prefill() -> None:
    # KV full and requests already waiting for blocks: a prefill would queue for its TTFT.
    gpu = replace(IDLE_GPU, running=5, waiting=4, kv_usage_perc=99.0)
    d = decide(knobs(), Loads(gpu, IDLE_CPU))
    assert d.route is Route.CPU_ONLY and d.code == "gpu-kv-blocked"
    assert "4 waiting" in d.reason
    # KV full but nothing waiting yet: the GPU still prefills, the decode goes to the CPU.
    full = decide(knobs(), Loads(replace(gpu, waiting=0), IDLE_CPU))
    assert full.route is Route.PD and full.code == "gpu-kv-full"


def test_capacity_offloads_when_the_gpu_has_a_waiting_queue() -> None:
    gpu = replace(IDLE_GPU, running=5, waiting=1, kv_usage_perc=40.0)
    d = decide(knobs(), Loads(gpu, IDLE_CPU))
    assert d.route is Route.PD and d.code == "gpu-queue"
    assert "1 requests waiting" in d.reason


def test_capacity_keeps_an_unsaturated_gpu_even_when_the_cpu_is_idle() -> None:
    # No marginal-throughput gamble: below every GPU limit the GPU serves (no harm).
    gpu = replace(IDLE_GPU, running=30, itl_ms=30.0, kv_usage_perc=60.0)
    d = decide(knobs(), Loads(gpu, IDLE_CPU, gpu_itl_slope_ms=0.5))
    assert d.route is Route.GPU_ONLY and d.code == "gpu-room"


def test_cpu_admission_comes_from_its_measured_latency_and_the_slo() -> None:
    saturated = replace(IDLE_GPU, waiting=2)
    k = knobs(cpu_decode_slo_ms=100.0, cpu_max_batch_size=64)
    cpu = replace(IDLE_CPU, running=4, itl_ms=60.0, itl_batch=4.0)
    loads = Loads(saturated, cpu, cpu_itl_slope_ms=5.0)
    most = cpu_slo_batch(k, loads)
    assert most == 10  # 4 + (0.9 x 100 - 60) / 5
    assert most == 4 + round((CPU_SLO_MARGIN * 100 - 60) / 5)
    ok = decide(k, Loads(saturated, replace(cpu, running=most - 1), cpu_itl_slope_ms=5.0))
    assert ok.route is Route.PD
    full = decide(k, Loads(saturated, replace(cpu, running=most), cpu_itl_slope_ms=5.0))
    assert full.route is Route.GPU_ONLY and full.code == "cpu-would-miss"
    assert "target 100 ms" in full.reason
    # The engine's own max_num_seqs caps it whatever the SLO allows.
    capped = Loads(saturated, replace(cpu, running=6), cpu_itl_slope_ms=5.0, cpu_max_num_seqs=6)
    assert "max_num_seqs" in decide(k, capped).reason


def test_an_unmeasured_cpu_takes_exactly_one_probe_request() -> None:
    assert CPU_PROBE_BATCH == 1
    saturated = replace(IDLE_GPU, waiting=2)
    k = knobs(cpu_max_batch_size=64)
    assert decide(k, Loads(saturated, IDLE_CPU)).route is Route.PD
    at = decide(k, Loads(saturated, replace(IDLE_CPU, running=1)))
    assert (at.route, at.code) == (Route.GPU_ONLY, "both-busy")
    assert "probe of 1" in at.reason


def test_modes_pin_the_route() -> None:
    assert decide(knobs(mode="gpu-only"), Loads(IDLE_GPU, IDLE_CPU)).route is Route.GPU_ONLY
    assert decide(knobs(mode="cpu-only"), Loads(IDLE_GPU, IDLE_CPU)).route is Route.CPU_ONLY
    pd = decide(knobs(mode="forced-pd"), Loads(IDLE_GPU, IDLE_CPU))
    assert pd.route is Route.PD and pd.token_limit == 0
    off = decide(
        knobs(enable_auto_pd_offload=False), Loads(replace(IDLE_GPU, running=999), IDLE_CPU)
    )
    assert off.route is Route.GPU_ONLY


def test_engine_down_fallbacks() -> None:
    gpu_down = decide(knobs(), Loads(UNAVAILABLE, IDLE_CPU))
    assert gpu_down.route is Route.CPU_ONLY and gpu_down.fallback
    assert decide(knobs(mode="gpu-only"), Loads(UNAVAILABLE, IDLE_CPU)).status == 503
    assert decide(knobs(mode="cpu-only"), Loads(IDLE_GPU, UNAVAILABLE)).status == 503
    forced = decide(knobs(mode="forced-pd"), Loads(IDLE_GPU, UNAVAILABLE))
    assert forced.route is Route.GPU_ONLY and forced.fallback
    both = decide(knobs(), Loads(UNAVAILABLE, UNAVAILABLE))
    assert both.route is Route.REJECTED and both.status == 503


def test_next_chunk_moves_back_only_to_an_idle_gpu() -> None:
    cpu = replace(IDLE_CPU, running=3, itl_ms=60.0, itl_batch=3.0)
    back = decide_next_chunk(knobs(), Loads(IDLE_GPU, cpu))
    assert back.route is Route.GPU_ONLY and back.code == "back"
    # One sequence on the GPU is enough to stay: the recompute would delay it.
    busy = Loads(replace(IDLE_GPU, running=1), cpu)
    stay = decide_next_chunk(knobs(max_num_seqs=64), busy)
    assert stay.route is Route.PD and stay.code == "stay"
    queued = Loads(replace(IDLE_GPU, waiting=1), cpu)
    assert decide_next_chunk(knobs(), queued).route is Route.PD
    hot = Loads(IDLE_GPU, cpu, gpu_temperature_c=95.0)
    assert decide_next_chunk(knobs(gpu_max_temperature_c=90.0), hot).route is Route.PD


def test_next_chunk_under_threshold_stays_on_cpu_like_syshax() -> None:
    loads = Loads(IDLE_GPU, replace(IDLE_CPU, throughput_tps=5.0))
    d = decide_next_chunk(knobs(algorithm="syshax-threshold"), loads)
    assert d.route is Route.PD and d.token_limit == 20


def test_next_chunk_leaves_a_dead_cpu() -> None:
    d = decide_next_chunk(knobs(), Loads(IDLE_GPU, UNAVAILABLE))
    assert d.route is Route.GPU_ONLY and d.fallback


def test_itl_slope_fit() -> None:
    assert fit_itl_slope([(1, 10.0)]) is None
    assert fit_itl_slope([(2, 10.0), (2, 11.0)]) is None
    assert fit_itl_slope([(1, 10.0), (3, 14.0), (5, 18.0)]) == pytest.approx(2.0)
    assert fit_itl_slope([(1, 10.0), (3, 8.0)]) == 0.0


def test_projected_itl_counts_sequences_sent_since_the_scrape() -> None:
    light = DeviceLoad(True, 1, 0, 0.0, 0.0, 10.0)
    assert projected_itl_ms(light, None) == pytest.approx(10.5)
    assert projected_itl_ms(replace(light, itl_ms=None), 1.0) is None
    # Measured at batch 2; the router has sent 3 more since: (3 + 1) x 1 ms on top.
    burst = DeviceLoad(True, 5, 0, 0.0, 0.0, 10.0, itl_batch=2.0)
    assert projected_itl_ms(burst, 1.0) == pytest.approx(14.0)


def test_a_hot_gpu_counts_as_saturated_and_a_full_host_stops_offload() -> None:
    k = knobs(gpu_max_temperature_c=85.0, cpu_max_memory_percent=95.0)
    hot = decide(k, Loads(IDLE_GPU, IDLE_CPU, gpu_temperature_c=85.0))
    assert hot.route is Route.PD and hot.code == "gpu-hot"
    assert decide(k, Loads(IDLE_GPU, IDLE_CPU, gpu_temperature_c=80.0)).code == "gpu-room"
    full_host = decide(
        k, Loads(IDLE_GPU, IDLE_CPU, gpu_temperature_c=90.0, host_memory_percent=95.0)
    )
    assert full_host.route is Route.GPU_ONLY and full_host.code == "both-busy"
    assert "host memory 95% >= 95%" in full_host.reason


def test_a_forced_mode_is_held_to_the_hard_limits() -> None:
    """X-Syshax-Mode picks the device, never past the temperature, memory, queue and CPU
    batch limits (the latency SLOs are not limits for it: a benchmark measures past them)."""

    def forced(mode: str, loads: Loads, **kw: object) -> tuple[Route, str]:
        k = knobs(mode=mode, **kw)
        d = hold_to_limits(decide(k, loads), k, loads)
        return d.route, d.code

    idle = Loads(IDLE_GPU, IDLE_CPU)
    assert forced("gpu-only", idle) == (Route.GPU_ONLY, "offload-off")
    assert forced("cpu-only", idle) == (Route.CPU_ONLY, "mode")
    assert forced("forced-pd", idle) == (Route.PD, "mode")
    hot = replace(idle, gpu_temperature_c=90.0)
    assert forced("gpu-only", hot) == (Route.REJECTED, "gpu-hot")
    assert forced("forced-pd", hot)[0] is Route.PD  # the decode leaves the hot GPU
    full = Loads(replace(IDLE_GPU, running=4, waiting=3), IDLE_CPU)
    assert forced("gpu-only", full, max_num_seqs=4, max_queue_size=3) == (
        Route.REJECTED,
        "queue-full",
    )
    assert forced("gpu-only", full, max_num_seqs=4, max_queue_size=4)[0] is Route.GPU_ONLY
    swapped = replace(idle, host_memory_percent=95.0)
    for mode in ("cpu-only", "forced-pd"):
        assert forced(mode, swapped) == (Route.REJECTED, "host-memory")
        busy = Loads(IDLE_GPU, replace(IDLE_CPU, running=8), cpu_inflight=8)
        assert forced(mode, busy, cpu_max_batch_size=8) == (Route.REJECTED, "cpu-full")
        capped = replace(busy, cpu_max_num_seqs=4, cpu_inflight=4)
        assert forced(mode, capped) == (Route.REJECTED, "cpu-full")
        # The cap counts the router's own sequences: a scrape still counting the ones that
        # ended since does not refuse a benchmark running at exactly its concurrency.
        lagging = replace(busy, cpu_inflight=7)
        assert forced(mode, lagging, cpu_max_batch_size=8)[0] is not Route.REJECTED
        # Far past its latency SLO, but below its caps: a benchmark may measure it there.
        slow = Loads(
            IDLE_GPU, replace(IDLE_CPU, running=7, itl_ms=900.0, itl_batch=7.0), cpu_inflight=7
        )
        assert forced(mode, slow)[0] is not Route.REJECTED
    # A rejection is a 429 that names the limit, like the policy's own.
    k = knobs(mode="cpu-only")
    refused = hold_to_limits(decide(k, swapped), k, swapped)
    assert refused.status == 429 and "cpu_max_memory_percent" in refused.reason
