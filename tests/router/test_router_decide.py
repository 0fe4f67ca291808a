"""The deciders are pure: every route and every reason is pinned here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.decide import (
    Loads,
    Route,
    decide,
    decide_next_chunk,
    fit_itl_slope,
    marginal_tps,
    projected_itl_ms,
    token_limit,
)
from router.engine_metrics import UNAVAILABLE, DeviceLoad
from syshax.policy_schema import PolicyKnobs

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


def test_capacity_offloads_past_the_gpu_latency_knee() -> None:
    gpu = replace(IDLE_GPU, running=10, itl_ms=49.0)
    d = decide(knobs(gpu_decode_slo_ms=50.0), Loads(gpu, IDLE_CPU, gpu_itl_slope_ms=2.0))
    assert d.route is Route.PD
    assert "knee" in d.reason


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


def test_capacity_goes_cpu_only_when_gpu_kv_is_full_and_queueing() -> None:
    gpu = replace(IDLE_GPU, running=5, waiting=4, kv_usage_perc=99.0)
    d = decide(knobs(), Loads(gpu, IDLE_CPU))
    assert d.route is Route.CPU_ONLY


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


def test_next_chunk_moves_back_to_gpu_once_it_has_room() -> None:
    busy = Loads(replace(IDLE_GPU, running=8), IDLE_CPU)
    assert decide_next_chunk(knobs(max_num_seqs=8), busy).route is Route.PD
    assert decide_next_chunk(knobs(max_num_seqs=64), busy).route is Route.GPU_ONLY


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


def test_marginal_throughput_shrinks_near_the_knee() -> None:
    light = DeviceLoad(True, 1, 0, 0.0, 0.0, 10.0)
    heavy = DeviceLoad(True, 40, 0, 0.0, 0.0, 50.0)
    assert marginal_tps(light, 0.5, 1.0) > marginal_tps(heavy, 5.0, 1.0)
    assert projected_itl_ms(light, None) == pytest.approx(10.5)
    assert projected_itl_ms(replace(light, itl_ms=None), 1.0) is None
