"""Scenarios, concurrency ladders, prompts and arrival times are pure and seeded."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from loadgen.scenarios import (
    SCENARIOS,
    doubling_ladder,
    parse_concurrency,
    resolve_scenario,
)
from loadgen.workload import arrival_offsets, build_requests, make_prompt


def test_mission_scenarios() -> None:
    assert (SCENARIOS["short"].input_tokens, SCENARIOS["short"].output_tokens) == (128, 256)
    assert (SCENARIOS["medium"].input_tokens, SCENARIOS["medium"].output_tokens) == (512, 1024)
    assert (SCENARIOS["long"].input_tokens, SCENARIOS["long"].output_tokens) == (2048, 512)
    assert SCENARIOS["short"].concurrency_levels == (1, 2, 4, 8, 16)
    assert SCENARIOS["medium"].concurrency_levels == (1, 2, 4, 8)
    assert SCENARIOS["long"].concurrency_levels == (1, 2, 4)


def test_resolve_scenario_overrides_and_custom() -> None:
    assert resolve_scenario("short") is SCENARIOS["short"]
    tweaked = resolve_scenario("short", output_tokens=16)
    assert (tweaked.name, tweaked.input_tokens, tweaked.output_tokens) == ("short", 128, 16)
    custom = resolve_scenario("custom", 10, 20)
    assert (custom.input_tokens, custom.output_tokens) == (10, 20)
    with pytest.raises(ValueError, match="both"):
        resolve_scenario("custom", 10, None)
    with pytest.raises(ValueError, match="unknown scenario"):
        resolve_scenario("huge")
    with pytest.raises(ValueError):
        resolve_scenario("custom", 0, 5)


def test_concurrency_forms() -> None:
    assert parse_concurrency("8") == (8,)
    assert parse_concurrency("8,1,4,2") == (1, 2, 4, 8)
    assert parse_concurrency("1-8") == (1, 2, 4, 8)
    assert parse_concurrency("1-12") == (1, 2, 4, 8, 12)
    assert parse_concurrency("1-4,16") == (1, 2, 4, 16)
    assert doubling_ladder(3, 3) == (3,)
    for bad in ("", "0", "8-1", "a", "1,,2", "99999"):
        with pytest.raises(ValueError):
            parse_concurrency(bad)


def test_prompts_have_exact_word_counts_and_follow_the_seed() -> None:
    assert len(make_prompt(128, random.Random(1)).split()) == 128
    first = build_requests(5, 32, 8, seed=7)
    again = build_requests(5, 32, 8, seed=7)
    other = build_requests(5, 32, 8, seed=8)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert len({r.prompt for r in first}) == 5
    assert all(r.prompt_tokens == 32 and r.max_tokens == 8 for r in first)
    assert [r.index for r in build_requests(2, 1, 1, 0, first_index=10)] == [10, 11]


def test_poisson_arrivals_end_at_count_over_rate() -> None:
    offsets = arrival_offsets(200, rate=10.0, burstiness=1.0, seed=3)
    assert offsets == sorted(offsets)
    assert offsets[-1] == pytest.approx(20.0)
    assert offsets == arrival_offsets(200, rate=10.0, burstiness=1.0, seed=3)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    # Exponential gaps: the coefficient of variation is about 1.
    assert 0.7 < statistics.pstdev(gaps) / statistics.mean(gaps) < 1.3


def test_burstiness_shapes_the_gaps() -> None:
    def cv(burstiness: float) -> float:
        offsets = arrival_offsets(400, 5.0, burstiness, seed=1)
        gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    assert cv(0.25) > 1.4  # burstier than Poisson
    assert cv(8.0) < 0.6  # more regular
    regular = arrival_offsets(4, 2.0, math.inf, seed=0)
    assert regular == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(0, 1.0, 1.0, seed=0) == []
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, seed=0)
