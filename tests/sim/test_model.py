"""The performance model and the batch scheduler, as pure functions in virtual time."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from common.presets import DEVICES, GIB, MODELS
from sim.engine import EngineConfig, build_scheduler, plan_capacity
from sim.perfmodel import (
    bind_cpu,
    decode_step_time,
    effective_hardware,
    parse_cpu_list,
    prefill_time,
    restrict_cpu,
)
from sim.scheduler import FinishReason, SeqStatus, Sequence
from sim.tokens import TokenModel
from sim.virtual import closed_loop

Q32 = MODELS["deepseek-r1-distill-qwen-32b"]


def config(device: str, **kw: object) -> EngineConfig:
    base = EngineConfig(device=DEVICES[device], model=Q32, served_model_name="m", engine_id="e")
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["a100-80gb", "kunpeng-920-7280z"])
def test_batching_makes_each_decoded_token_cheaper(device: str) -> None:
    hw = effective_hardware(DEVICES[device])
    per_token = [decode_step_time(hw, Q32, b, 256) / b for b in (1, 2, 8, 32)]
    assert per_token == sorted(per_token, reverse=True)
    assert per_token[-1] < per_token[0] / 10  # the weight read is shared by the batch
    # A step of one sequence is weight-bandwidth bound: weights / effective bandwidth.
    step1 = decode_step_time(hw, Q32, 1, 256)
    assert step1 == pytest.approx(Q32.weight_bytes / hw.bandwidth + hw.step_overhead_s, rel=0.02)


def test_prefill_is_compute_bound_and_grows_with_the_prompt() -> None:
    hw = effective_hardware(DEVICES["a100-80gb"])
    t1k, t2k = prefill_time(hw, Q32, 1024), prefill_time(hw, Q32, 2048)
    assert t1k == pytest.approx(2 * Q32.params * 1024 / hw.flops, rel=0.1)
    assert 1.9 < t2k / t1k < 2.3  # linear part doubles, attention grows a bit faster


def test_gpu_is_faster_than_cpu_for_both_phases() -> None:
    gpu, cpu = (
        effective_hardware(DEVICES["a100-80gb"]),
        effective_hardware(DEVICES["kunpeng-920-7280z"]),
    )
    assert prefill_time(gpu, Q32, 128) * 4 < prefill_time(cpu, Q32, 128)
    assert decode_step_time(gpu, Q32, 1, 128) * 3 < decode_step_time(cpu, Q32, 1, 128)


def test_kv_capacity_follows_memory_rules() -> None:
    gpu = plan_capacity(config("a100-80gb", gpu_memory_utilization=0.8))
    expected = 80 * GIB * 0.8 - Q32.weight_bytes - 2 * GIB
    assert gpu.kv_bytes == pytest.approx(expected)
    assert gpu.num_blocks == int(expected // (Q32.kv_bytes_per_token * 16))
    cpu = plan_capacity(config("kunpeng-920-7280z", kv_cache_space_gb=8))
    assert cpu.kv_bytes == 8 * GIB
    assert cpu.max_model_len == 8 * GIB // Q32.kv_bytes_per_token  # clipped to what fits
    two = plan_capacity(config("a100-80gb", tensor_parallel_size=2))
    assert two.num_blocks > 2 * plan_capacity(config("a100-80gb")).num_blocks


@pytest.mark.parametrize(
    ("device", "throughput", "ttft"),
    [("a100-80gb", 158.2, 0.146), ("kunpeng-920-7280z", 32.6, 0.892)],
)
def test_calibrated_presets_land_on_the_documented_baselines(
    device: str, throughput: float, ttft: float
) -> None:
    # docs/simulator.md, Calibration: short scenario, closed loop of 2 clients.
    r = closed_loop(
        config(device, kv_cache_space_gb=40),
        concurrency=2,
        prompt_tokens=128,
        max_tokens=256,
        requests=20,
    )
    assert r.throughput_tok_s == pytest.approx(throughput, rel=0.03)
    assert r.ttft_mean_s == pytest.approx(ttft, rel=0.03)


def test_throughput_rises_with_concurrency_on_both_devices() -> None:
    for device in ("a100-80gb", "kunpeng-920-7280z"):
        cfg = config(device, kv_cache_space_gb=40)
        rates = [
            closed_loop(
                cfg, concurrency=c, prompt_tokens=128, max_tokens=64, requests=2 * c
            ).throughput_tok_s
            for c in (1, 4, 16)
        ]
        assert rates == sorted(rates)


def _run_to_completion(
    cfg: EngineConfig, n: int, prompt: int, out: int
) -> tuple[list[Sequence], int]:
    """Run n sequences to the end; returns them and the most that sat in swap at once."""
    cap = plan_capacity(cfg)
    sched = build_scheduler(cfg, cap, effective_hardware(cfg.device), TokenModel(0))
    seqs = [Sequence(str(i), prompt, out, tail=[i]) for i in range(n)]
    for s in seqs:
        sched.add(s)
    now, peak_swapped = 0.0, 0
    while sched.has_work():
        step = sched.plan(now)
        assert step is not None
        now += step.duration
        sched.complete(step, now)
        peak_swapped = max(peak_swapped, len(sched.swapped))
        assert sched.free_blocks >= 0
    assert sched.free_blocks == cap.num_blocks  # every block came back
    return seqs, peak_swapped


def test_full_kv_cache_preempts_by_recompute_and_everything_finishes() -> None:
    # 0.05 GiB of CPU KV = 200 tokens: room for ~2 sequences of 100 tokens at a time.
    cfg = config("kunpeng-920-7280z", kv_cache_space_gb=0.05, max_model_len=150)
    seqs, _ = _run_to_completion(cfg, 6, 40, 60)
    assert all(
        s.status == SeqStatus.FINISHED and s.finish_reason == FinishReason.LENGTH for s in seqs
    )
    assert all(s.generated == 60 for s in seqs)
    assert sum(s.preemptions for s in seqs) > 0


def test_swap_mode_moves_sequences_to_swap_space() -> None:
    cfg = config(
        "kunpeng-920-7280z", kv_cache_space_gb=0.05, max_model_len=150, preemption_mode="swap"
    )
    seqs, peak_swapped = _run_to_completion(cfg, 6, 40, 60)
    assert all(s.generated == 60 for s in seqs)
    assert peak_swapped >= 1


def test_max_num_seqs_bounds_the_batch() -> None:
    cfg = config("a100-80gb", max_num_seqs=3)
    cap = plan_capacity(cfg)
    sched = build_scheduler(cfg, cap, effective_hardware(cfg.device), TokenModel(0))
    for i in range(7):
        sched.add(Sequence(str(i), 10, 5, tail=[i]))
    step = sched.plan(0.0)
    assert step is not None and len(step.scheduled) == 3
    assert len(sched.running) == 3 and len(sched.waiting) == 4


def test_cpu_lists_parse_like_vllm_binds() -> None:
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list("0-1|4-5") == {0, 1, 4, 5}
    with pytest.raises(ValueError):
        parse_cpu_list("5-2")
    with pytest.raises(ValueError):
        restrict_cpu(DEVICES["kunpeng-920-7280z"], {500})
    gpu = DEVICES["a100-80gb"]
    assert restrict_cpu(gpu, {0}) is gpu  # a GPU engine ignores CPU binding


def test_a_cpu_binding_names_the_presets_cores_and_unbound_is_the_whole_device() -> None:
    kunpeng = DEVICES["kunpeng-920-7280z"]
    for unbound in ("", " ", "auto", "all", "nobind"):
        assert bind_cpu(kunpeng, unbound) is kunpeng
    two = bind_cpu(kunpeng, "0-1")  # two of the preset's 160 cores, not "a 2-core host"
    assert (two.cores, two.numa_nodes) == (2, 1)
    assert two.peak_flops == pytest.approx(kunpeng.peak_flops / 80)
    assert bind_cpu(DEVICES["a100-80gb"], "0-1") is DEVICES["a100-80gb"]


def test_frontend_emits_a_steps_tokens_one_after_another_and_queues() -> None:
    cfg = config("a100-80gb", output_token_overhead_s=0.005)  # 5 ms per token: overloaded
    cap = plan_capacity(cfg)
    sched = build_scheduler(cfg, cap, effective_hardware(cfg.device), TokenModel(0))
    seqs = [Sequence(str(i), 4, 3, tail=[i]) for i in range(10)]
    for s in seqs:
        sched.add(s)
    now = 0.0
    while sched.has_work():
        step = sched.plan(now)
        assert step is not None
        now += step.duration
        sched.complete(step, now)
    firsts = [s.token_times[0] for s in seqs]
    assert [b - a for a, b in itertools.pairwise(firsts)] == pytest.approx([0.005] * 9)
    # A step of ~12 ms cannot drain 50 ms of output: the next step's outputs queue behind.
    assert seqs[0].token_times[1] - seqs[0].token_times[0] == pytest.approx(0.05)


def test_recompute_preemption_drops_handed_over_kv_too() -> None:
    # 12 blocks of 16 tokens. B (60-token prompt) and A (101 tokens of context whose KV came
    # through a handoff) both fit at first; as they grow, A - the newest - is preempted.
    cfg = config("kunpeng-920-7280z", kv_cache_space_gb=0.05)
    cap = plan_capacity(cfg)
    assert cap.num_blocks == 12
    sched = build_scheduler(cfg, cap, effective_hardware(cfg.device), TokenModel(0))
    b = Sequence("b", 60, 100, tail=[1])
    a = Sequence("a", 100, 20, tail=[2], resumed_tokens=1, imported_tokens=100)
    sched.add(b)
    sched.add(a)
    chunks_of_a: list[int] = []
    now = 0.0
    while sched.has_work():
        step = sched.plan(now)
        assert step is not None
        chunks_of_a += [c for s, c in step.scheduled if s is a]
        now += step.duration
        sched.complete(step, now)
    assert a.preemptions >= 1 and a.generated == 20 and b.generated == 100
    assert chunks_of_a[0] == 1  # first admission: only the last token, the rest was imported
    assert max(chunks_of_a[1:]) > 100  # after preemption: the whole context is prefilled again
