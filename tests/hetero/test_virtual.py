"""The virtual-time deployment: the simulator's schedulers routed by the router's deciders.

Virtual time is deterministic, so these pin behaviour, not speed: where requests go, that
every token of every request arrives once, and that the default policy leaves an unsaturated
GPU alone and relieves a saturated one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetero.sweep import PAIRS, deployment, measure, sweep
from loadgen.scenarios import Scenario

PAIR = PAIRS["a10-xeon"]
DECODE_HEAVY = Scenario("decode-heavy-small", 128, 1024, 1, 1)


def test_gpu_only_never_touches_the_cpu() -> None:
    stats = deployment(PAIR, "gpu").run(rate=1.0, requests=40, prompt_tokens=64, output_tokens=32)
    assert all(r.ok and r.tokens == 32 and r.cpu_tokens == 0 for r in stats.requests)
    assert stats.decisions["gpu-only"] == 40
    assert "cpu" not in stats.busy


def test_at_low_load_hetero_is_gpu_only_token_for_token() -> None:
    kwargs = dict(rate=0.5, requests=30, prompt_tokens=128, output_tokens=64)
    gpu = deployment(PAIR, "gpu").run(**kwargs)  # type: ignore[arg-type]
    hetero = deployment(PAIR, "hetero").run(**kwargs)  # type: ignore[arg-type]
    assert hetero.decisions["gpu-only:gpu-room"] == 30
    assert [r.first_token_at for r in hetero.requests] == [r.first_token_at for r in gpu.requests]
    assert [r.last_token_at for r in hetero.requests] == [r.last_token_at for r in gpu.requests]


def test_saturated_gpu_offloads_decodes_and_every_token_arrives_once() -> None:
    stats = deployment(PAIR, "hetero").run(
        rate=8.0, requests=200, prompt_tokens=128, output_tokens=1024
    )
    offloaded = [r for r in stats.requests if r.cpu_tokens]
    assert offloaded, stats.decisions
    assert all(r.ok and r.tokens == 1024 for r in stats.requests)
    # A PD request's first token comes from the GPU's prefill, the rest from the CPU (or
    # the GPU again after a move back).
    assert all(r.cpu_tokens <= 1023 for r in offloaded)
    reasons = {k for k in stats.decisions if k.startswith("pd:")}
    assert reasons <= {"pd:gpu-kv-full", "pd:gpu-queue", "pd:gpu-knee", "pd:gpu-max-seqs"}
    # The CPU's batch never passed its engine's max_num_seqs.
    assert stats.busy["cpu"] > 0


def test_the_default_policy_raises_attainment_where_the_gpu_saturates() -> None:
    gpu, _ = measure(PAIR, DECODE_HEAVY, "gpu", 8.0, requests=200)
    hetero, _ = measure(PAIR, DECODE_HEAVY, "hetero", 8.0, requests=200)
    assert gpu.attainment < 90.0  # the rate is past the GPU's knee
    assert hetero.attainment > gpu.attainment


def test_sweep_bisects_and_records_each_rate() -> None:
    search, runs = sweep(PAIR, DECODE_HEAVY, "gpu", (1.0, 4.0, 16.0), requests=60, bisections=2)
    assert set(runs) == {p.rate for p in search.points}
    assert [p.bisection for p in search.points if p.rate in (1.0, 4.0, 16.0)] == [False] * 3
    assert search.max_goodput_rate is not None


def test_cpu_only_needs_a_cpu_engine() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        from hetero.virtual import VirtualDeployment

        VirtualDeployment(None, None, replace(deployment(PAIR, "gpu").knobs))
