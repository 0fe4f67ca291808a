"""Mixed traffic in virtual time: requests of SLO classes through the router's deciders and
engines that schedule by priority, and a quick run of the benchmark's core."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from common.policy_schema import PolicyKnobs, SloClass
from hetero import virtual
from hetero.mixed import (
    BATCH_TPOT_FACTOR,
    MIXED_MODES,
    MixedLoad,
    cpu_batch_capacity,
    measure_mixed,
    mixed_deployment,
    mixed_knobs,
    mixed_requests,
    run_mixed,
)
from hetero.sweep import PAIRS
from hetero.virtual import Request, RunStats
from loadgen.scenarios import MIXED_SCENARIOS
from router.decide import Decision, Loads, Route
from router.decide import decide as real_decide
from router.flow import TICK_SECONDS

PAIR = PAIRS["a10-xeon"]
TRAFFIC = MIXED_SCENARIOS["chat-and-batch"]


def classed(
    n: int, slo_class: str, rate: float, prompt: int = 64, output: int = 48
) -> list[Request]:
    return [Request(i, prompt, output, i / rate, slo_class=slo_class) for i in range(n)]


def test_knobs_take_the_classes_targets_from_the_pair() -> None:
    aware = mixed_knobs(PAIR, "class-aware")
    assert aware.class_aware and not mixed_knobs(PAIR, "class-blind").class_aware
    assert (aware.interactive_ttft_ms, aware.interactive_tpot_ms) == (
        PAIR.slo_ttft_ms,
        PAIR.slo_tpot_ms,
    )
    assert aware.batch_tpot_ms == BATCH_TPOT_FACTOR * PAIR.slo_tpot_ms
    assert mixed_knobs(PAIR, "gpu").mode == "gpu-only"
    with pytest.raises(ValueError, match="unknown mode"):
        mixed_knobs(PAIR, "hetero")


def test_class_aware_decodes_batch_on_the_cpu_when_it_meets_the_batch_target() -> None:
    # A light load: the GPU has room for everything, so only the class sends batch away.
    reqs = sorted(
        classed(10, "interactive", 1.0) + classed(10, "batch", 1.0),
        key=lambda r: (r.arrival, r.slo_class or ""),
    )
    stats = mixed_deployment(PAIR, "class-aware").run_requests(reqs)
    batch = [r for r in stats.requests if r.slo_class == "batch"]
    interactive = [r for r in stats.requests if r.slo_class == "interactive"]
    assert all(r.ok for r in stats.requests)
    # Served wholly on the CPU, prefill included, since the CPU meets batch's TTFT and TPOT
    # (decision record 58): no batch prefill queues on the GPU.
    assert all(r.route == "cpu-only" and r.cpu_tokens == r.tokens for r in batch), stats.decisions
    assert all(r.route == "gpu-only" and r.cpu_tokens == 0 for r in interactive)
    assert stats.decisions["batch:cpu-only:class-cpu-only"] == 10
    # Without class awareness the same batch requests stay on the GPU that has room.
    fresh = [replace(r, tokens=0, first_token_at=None, last_token_at=None, route="") for r in reqs]
    blind = mixed_deployment(PAIR, "class-blind").run_requests(fresh)
    assert all(r.route == "gpu-only" for r in blind.requests), blind.decisions


def test_class_aware_keeps_batch_off_a_cpu_that_misses_the_batch_target() -> None:
    knobs = replace(mixed_knobs(PAIR, "class-aware"), batch_tpot_ms=1.0)
    deployment = mixed_deployment(PAIR, "class-aware", knobs)
    # The first requests probe the never-measured CPU; once measured (>1 ms) it is refused.
    stats = deployment.run_requests(classed(30, "batch", 0.5))
    routes = [r.route for r in stats.requests]
    assert routes[-10:] == ["gpu-only"] * 10, stats.decisions


def test_engines_schedule_requests_at_their_class_priority() -> None:
    deployment = mixed_deployment(PAIR, "class-aware")
    assert deployment.gpu is not None and deployment.cpu is not None
    assert deployment.gpu.config.scheduling_policy == "priority"
    seen: list[tuple[str | None, int]] = []
    add = deployment.gpu.sched.add

    def spy(seq):  # type: ignore[no-untyped-def]
        seen.append((seq.sink.request.slo_class, seq.priority))
        add(seq)

    deployment.gpu.sched.add = spy  # type: ignore[method-assign]
    # Batch goes to the GPU only while the CPU cannot meet its targets: here a CPU that
    # misses batch's TPOT, so its prefill (and decode) take the GPU, at batch's priority.
    knobs = replace(deployment.knobs, batch_tpot_ms=0.001)
    deployment.knobs = knobs
    deployment.run_requests(
        [*classed(2, "interactive", 1.0), Request(9, 64, 8, 5.0, slo_class="batch")]
    )
    assert ("interactive", knobs.interactive_priority) in seen
    assert ("batch", knobs.batch_priority) in seen


def test_mixed_requests_hold_both_streams_in_arrival_order() -> None:
    load = MixedLoad(interactive_rate=2.0, batch_rate=0.5, window_s=20.0, warmup_s=10.0)
    reqs = mixed_requests(TRAFFIC, load, seed=3)
    interactive = [r for r in reqs if r.slo_class == "interactive"]
    batch = [r for r in reqs if r.slo_class == "batch"]
    assert len(interactive) == 40 and len(batch) == 15
    assert min(r.arrival for r in interactive) >= 10.0
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    assert {(r.prompt_tokens, r.output_tokens) for r in batch} == {(512, 1024)}
    assert mixed_requests(TRAFFIC, load, seed=3) == reqs


def test_a_point_reports_each_class() -> None:
    load = MixedLoad(interactive_rate=2.0, batch_rate=0.2, window_s=10.0, warmup_s=5.0)
    point, _ = measure_mixed(PAIR, TRAFFIC, "class-aware", load)
    assert point.interactive.requests == 20 and point.batch.requests == 3
    assert point.batch.cpu_tokens > 0
    assert point.interactive.tpot_p50_ms is not None
    assert point.meets()


def test_cpu_batch_capacity_is_positive_on_both_pairs() -> None:
    assert all(cpu_batch_capacity(p, TRAFFIC) > 0 for p in PAIRS.values())


def test_quick_benchmark_core_returns_all_three_modes() -> None:
    result = run_mixed(
        PAIR,
        TRAFFIC,
        requests=30,
        interactive_rates=(4.0, 8.0),
        ladder=(0.05, 0.2),
        bisections=0,
        warmup_s=10.0,
    )
    assert result.interactive.max_goodput_rate is not None
    assert set(result.searches) == set(MIXED_MODES)
    for search in result.searches.values():
        assert search.points
        assert all(p.interactive.requests > 0 for p in search.points)
    modes = result.to_dict()["modes"]
    assert isinstance(modes, dict) and set(modes) == set(MIXED_MODES)


# -- the router's flow control in virtual time --------------------------------------------


def one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decider, with every request refused (a 429) while the deployment serves anything:
    the engines take one request at a time, and the rest wait in the router's queues."""

    def decide(
        knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None, **given: Any
    ) -> Decision:
        if loads.gpu.running or loads.cpu.running:
            return Decision(Route.REJECTED, reason="busy", status=429, code="queue-full")
        return real_decide(knobs, loads, slo, **given)

    monkeypatch.setattr(virtual, "decide", decide)


def served_order(stats: RunStats) -> list[int]:
    done = [r for r in stats.requests if r.ok]
    return [r.index for r in sorted(done, key=lambda r: r.first_token_at or 0.0)]


def test_a_refused_request_waits_in_its_class_queue_and_is_served_when_room_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one_at_a_time(monkeypatch)
    # Three batch requests at once, then an interactive one while they wait.
    reqs = [*classed(3, "batch", 1000.0), Request(3, 64, 48, 0.5, slo_class="interactive")]
    stats = mixed_deployment(PAIR, "class-aware").run_requests(reqs)
    assert all(r.ok for r in stats.requests), [r.error for r in stats.requests]
    # The first is served at once; the interactive request, of a higher priority, goes
    # before the batch requests that waited longer; within a class, first come first served.
    assert served_order(stats) == [0, 3, 1, 2]
    assert [r.queued_s > 0 for r in stats.requests] == [False, True, True, True]
    assert stats.decisions["batch:queued"] == 2 and stats.decisions["interactive:queued"] == 1
    # The wait is part of the request's TTFT, as its client sees it.
    assert all((r.ttft or 0.0) >= r.queued_s for r in stats.requests)


def test_an_arrival_waits_behind_its_class_rather_than_overtake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one_at_a_time(monkeypatch)
    deployment = mixed_deployment(PAIR, "class-aware")
    # Request 1 waits behind 0; request 2 arrives just as the engines would take it, but
    # 1 waits ahead of it: 1 is planned first.
    stats = deployment.run_requests(classed(3, "batch", 1000.0))
    assert served_order(stats) == [0, 1, 2]


def test_a_sheddable_request_waits_at_most_its_ttft_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one_at_a_time(monkeypatch)
    knobs = replace(mixed_knobs(PAIR, "class-aware"), batch_ttft_ms=2000.0)
    reqs = [Request(i, 64, 400, i / 1000.0, slo_class="batch") for i in range(3)]
    stats = mixed_deployment(PAIR, "class-aware", knobs).run_requests(reqs)
    first, *rest = stats.requests
    assert first.ok  # 400 tokens take longer than the others may wait
    for r in rest:
        assert not r.ok and r.error == "429: timeout"
        assert 2.0 <= r.queued_s <= 2.0 + TICK_SECONDS + 1e-9
    assert stats.decisions["batch:rejected:timeout"] == 2


def test_full_queues_evict_a_sheddable_request_for_one_that_may_not_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one_at_a_time(monkeypatch)
    knobs = replace(mixed_knobs(PAIR, "class-aware"), max_queue_size=2)
    reqs = [
        *classed(3, "batch", 1000.0),  # 0 served, 1 and 2 wait: the queues are full
        Request(3, 64, 48, 0.01, slo_class="batch"),  # turned away at once
        Request(4, 64, 48, 0.02, slo_class="interactive"),  # evicts batch 2, the newest
    ]
    stats = mixed_deployment(PAIR, "class-aware", knobs).run_requests(reqs)
    errors = {r.index: r.error for r in stats.requests if not r.ok}
    assert errors == {2: "429: evicted", 3: "429: queue-full"}
    assert served_order(stats) == [0, 4, 1]


def test_requests_without_a_class_never_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    one_at_a_time(monkeypatch)
    reqs = [Request(i, 64, 48, i / 1000.0) for i in range(3)]
    stats = mixed_deployment(PAIR, "class-aware").run_requests(reqs)
    assert [r.ok for r in stats.requests] == [True, False, False]
    assert stats.requests[1].error == "429: busy"
    assert not any(k.endswith(":queued") for k in stats.decisions)


def test_class_aware_batch_waits_for_the_cpu_instead_of_taking_a_busy_gpu() -> None:
    # A CPU with two seats for batch, interactive traffic keeping the GPU busy: the batch
    # requests the CPU has no seat for wait in the router (class-wait) and reach the CPU
    # when a seat frees; none decodes on the GPU, and no interactive request waits.
    knobs = replace(mixed_knobs(PAIR, "class-aware"), cpu_max_batch_size=2)
    reqs = sorted(
        classed(60, "interactive", 6.0, prompt=128, output=256)
        + classed(6, "batch", 1.0, output=64),
        key=lambda r: (r.arrival, r.slo_class or ""),
    )
    reqs = [replace(r, index=i) for i, r in enumerate(reqs)]
    stats = mixed_deployment(PAIR, "class-aware", knobs).run_requests(reqs)
    batch = [r for r in stats.requests if r.slo_class == "batch"]
    assert all(r.ok for r in stats.requests)
    assert stats.decisions["batch:rejected:class-wait"] == 0  # a wait is not a refusal
    assert stats.decisions["batch:queued"] > 0, stats.decisions
    # Served wholly on the CPU (decision record 58): every token, the first included.
    assert all(r.cpu_tokens == r.tokens for r in batch), stats.decisions
    assert stats.decisions["interactive:queued"] == 0
