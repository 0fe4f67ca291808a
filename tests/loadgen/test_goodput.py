"""Goodput at SLO: rate parsing, the max-goodput search and its chart. Pure, no I/O."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from loadgen.chart import sweep_svg
from loadgen.goodput import (
    GoodputSearch,
    RatePoint,
    check_attainment,
    format_sweeps,
    parse_rates,
    ratio_line,
)


def point(rate: float, attainment: float, requests: int = 100) -> RatePoint:
    good = round(requests * attainment / 100)
    return RatePoint(rate, requests, good, duration_s=requests / rate, output_tokens=10 * good)


def run(search: GoodputSearch, attainment_at) -> list[float]:  # type: ignore[no-untyped-def]
    asked = []
    while (rate := search.next_rate()) is not None:
        asked.append(rate)
        search.record(point(rate, attainment_at(rate)))
    return asked


def test_parse_rates_accepts_one_rate_inf_or_an_ascending_list() -> None:
    assert parse_rates("4") == (4.0,)
    assert parse_rates("inf") == (float("inf"),)
    assert parse_rates("0.5, 1,2") == (0.5, 1.0, 2.0)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("2,1", "strictly ascending"),
        ("1,1", "strictly ascending"),
        ("0", "positive"),
        ("-1,2", "positive"),
        ("1,x", "not a number"),
        ("1,,2", "empty item"),
        ("1,inf", "inf"),
        ("nan", "positive"),
        (",".join(str(i) for i in range(1, 70)), "at most 64"),
    ],
)
def test_parse_rates_refuses_bad_sweeps_naming_the_flag(text: str, words: str) -> None:
    with pytest.raises(ValueError, match="--request-rate") as info:
        parse_rates(text)
    assert words in str(info.value)


@pytest.mark.parametrize("value", [0.0, -5.0, 100.5, float("nan")])
def test_attainment_must_lie_in_zero_to_hundred(value: float) -> None:
    with pytest.raises(ValueError, match=r"--slo-attainment must be in \(0, 100\]"):
        check_attainment(value)
    assert check_attainment(100.0) == 100.0


def test_sweep_measures_every_listed_rate_and_finds_the_knee() -> None:
    search = GoodputSearch((1.0, 2.0, 4.0, 8.0), target=90.0)
    asked = run(search, lambda r: 100.0 if r <= 2 else 50.0)
    assert asked == [1.0, 2.0, 4.0, 8.0]
    assert search.max_goodput_rate == 2.0
    assert search.saturated
    assert "max goodput 2 req/s" in search.verdict()


def test_bisection_narrows_between_the_last_met_and_first_missed_rate() -> None:
    search = GoodputSearch((1.0, 2.0, 4.0, 8.0), target=90.0, bisections=4)
    asked = run(search, lambda r: 100.0 if r <= 3.1 else 10.0)
    assert asked[:4] == [1.0, 2.0, 4.0, 8.0]
    assert asked[4:] == [3.0, 3.5, 3.25, 3.125]
    assert search.max_goodput_rate == 3.0
    assert [p.rate for p in search.points] == sorted(p.rate for p in search.points)


def test_bisection_stops_when_the_step_is_small() -> None:
    search = GoodputSearch((10.0, 10.2), target=90.0, bisections=10)
    run(search, lambda r: 100.0 if r < 10.1 else 0.0)
    assert len(search.points) == 2  # 0.2 apart is within 5% of 10.2


def test_a_rate_missing_below_a_meeting_one_caps_the_max_goodput() -> None:
    # Noise: 4 misses, 8 meets. The max goodput stays below the first miss.
    search = GoodputSearch((2.0, 4.0, 8.0), target=90.0)
    run(search, lambda r: 50.0 if r == 4.0 else 95.0)
    assert search.max_goodput_rate == 2.0


def test_no_rate_meeting_the_target_is_said_plainly() -> None:
    search = GoodputSearch((1.0, 2.0), target=90.0, bisections=4)
    asked = run(search, lambda r: 40.0 if r == 1.0 else 20.0)
    assert asked == [1.0, 2.0]  # nothing below the first rate to bisect
    assert search.max_goodput_rate is None
    assert search.verdict() == "no rate met the 90% target (best attainment 40.0%)"
    table = format_sweeps({"gpu": search})
    assert "| gpu | 1 | 100 | 40.0% |" in table
    assert "gpu: no rate met" in table


def test_every_rate_meeting_says_the_max_is_at_least_the_last() -> None:
    search = GoodputSearch((1.0, 2.0), bisections=3)
    run(search, lambda r: 100.0)
    assert not search.saturated
    assert search.verdict().endswith("max goodput is at least 2")


def test_ratio_and_chart_of_two_modes() -> None:
    gpu = GoodputSearch((1.0, 2.0, 4.0))
    hetero = GoodputSearch((1.0, 2.0, 4.0))
    run(gpu, lambda r: 100.0 if r <= 1 else 10.0)
    run(hetero, lambda r: 100.0 if r <= 2 else 10.0)
    assert ratio_line({"gpu": gpu, "hetero": hetero}, "hetero", "gpu") == (
        "hetero / gpu max goodput: 2.00x"
    )
    svg = sweep_svg({"gpu": gpu, "hetero": hetero}, "test <run>")
    root = ET.fromstring(svg)  # well-formed, title escaped
    assert root.tag.endswith("svg")
    text = "".join(root.itertext())
    assert "hetero: max goodput 2 req/s" in text and "test <run>" in text
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 4  # attainment and throughput, per mode


def test_router_knobs_for_fast_simulators_scale_only_the_routers_own_clocks() -> None:
    from common.policy_schema import PolicyKnobs
    from loadgen.simproc import SPEED_SCALED_KNOBS, knob_flags_for_speed

    flags = knob_flags_for_speed(PolicyKnobs(cpu_decode_slo_ms=90.0), 4.0)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    # The simulator reports ITL in simulated seconds: the latency knobs are left alone.
    assert pairs["--cpu-decode-slo-ms"] == "90" and pairs["--gpu-decode-slo-ms"] == "50"
    assert pairs["--metrics-interval-seconds"] == "0.25"
    assert pairs["--request-timeout-seconds"] == "150"
    assert pairs["--cpu-throughput-threshold"] == "40"  # tokens per wall second
    assert pairs["--mode"] == "auto" and pairs["--enable-auto-pd-offload"] == "true"
    only = knob_flags_for_speed(PolicyKnobs(), 4.0, only=SPEED_SCALED_KNOBS)
    assert only[::2] == [
        "--cpu-throughput-threshold",
        "--request-timeout-seconds",
        "--metrics-interval-seconds",
    ]
