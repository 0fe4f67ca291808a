"""The live matrix's generator and its report, on canned results (no processes)."""

from __future__ import annotations

import json
import math

from hetero.live import Cell, Point, document, format_table, targets
from hetero.matrix import (
    DECODE_HEAVY_RATIO,
    KNEE_REQUESTS,
    PAIRS,
    MatrixScenario,
    context_limit,
    generate,
    rate_triple,
    steady_requests,
)


def cheap(seed: int = 0, count: int = 12, mixed: int = 2) -> tuple[MatrixScenario, ...]:
    """The matrix with a fixed knee and interactive rate: the draws without the model."""
    return generate(
        seed, count, mixed, knee=lambda p, s: 1.0, knee_hetero=lambda p, s: 1.3,
        interactive=lambda p, t: 10.0,
    )  # fmt: skip


def test_the_same_seed_gives_the_same_matrix() -> None:
    drawn = [(s.id, s.input_tokens, s.output_tokens, s.slo_ttft_ms, s.slo_tpot_ms, s.rates)
             for s in cheap()]  # fmt: skip
    assert drawn[:6] == [
        ("s0-00-a10-xeon-prompt-heavy", 3072, 128, 1500.0, 100.0, (0.6, 1.0, 2.0)),
        ("s0-01-a100-kunpeng-prompt-heavy", 2048, 128, 5000.0, 187.5, (0.4, 0.8, 2.0)),
        ("s0-02-a10-xeon-balanced", 256, 128, 3000.0, 100.0, (0.6, 0.8, 2.0)),
        ("s0-03-a100-kunpeng-balanced", 256, 384, 3750.0, 187.5, (0.5, 1.0, 1.5)),
        ("s0-04-a10-xeon-decode-heavy", 256, 2048, 2000.0, 125.0, (0.6, 0.8, 1.3, 2.0)),
        ("s0-05-a100-kunpeng-decode-heavy", 256, 4096, 5000.0, 120.0, (0.6, 0.8, 1.3, 1.5)),
    ]
    assert [s.id for s in cheap()[-2:]] == ["s0-m0-a10-xeon-mixed", "s0-m1-a100-kunpeng-mixed"]
    assert cheap() == cheap()
    assert cheap(1) != cheap()


def test_every_scenario_fits_and_its_rates_climb_past_the_knee() -> None:
    for seed in range(5):
        matrix = cheap(seed)
        single = [s for s in matrix if not s.mixed]
        assert len(single) == 12 and {s.pair for s in single} == set(PAIRS)
        assert {s.shape for s in single} == {"prompt-heavy", "balanced", "decode-heavy"}
        for s in single:
            assert s.input_tokens + s.output_tokens <= context_limit(PAIRS[s.pair])
            assert list(s.rates) == sorted(set(s.rates)) and s.rates[-1] > s.knee
            assert len(s.rates) == (4 if s.decode_heavy else 3)
            assert (s.hetero_knee in s.rates) if s.decode_heavy else s.hetero_knee is None
            assert s.decode_heavy == (s.shape == "decode-heavy")
            assert s.decode_heavy == (s.output_tokens >= DECODE_HEAVY_RATIO * s.input_tokens)
        for s in matrix:
            if s.mixed:
                assert s.interactive_rate == 10.0 and s.rates[0] < s.rates[1] < s.rates[2]


def test_only_keeps_the_ids_named_and_draws_the_rest_alike() -> None:
    calls: list[str] = []

    def knee(pair: object, scenario: object) -> float:
        calls.append("knee")
        return 1.0

    def hetero(pair: object, scenario: object) -> float:
        calls.append("hetero")
        return 1.3

    one = generate(
        0, only={"s0-04-a10-xeon-decode-heavy"}, knee=knee, knee_hetero=hetero,
        interactive=lambda p, t: 1,
    )  # fmt: skip
    assert [s.id for s in one] == ["s0-04-a10-xeon-decode-heavy"]
    assert calls == ["knee", "hetero"]
    assert one[0] == cheap()[4]


def test_rate_triple_is_strictly_increasing() -> None:
    assert rate_triple(0.1234, (0.5, 0.5, 2.0)) == (0.062, 0.068, 0.25)


def point(goodput: float, attainment: float = 100.0, tokens: float | None = None) -> Point:
    return Point(60, round(60 * attainment / 100), attainment, goodput, tokens)


def cells() -> list[Cell]:
    matrix = cheap(count=12, mixed=1)
    out = []
    for s in matrix:
        for rate in s.rates:
            if s.mixed:
                live = {"gpu": point(10, 100, 50.0), "hetero": point(10, 99.5, 100.0)}
                virtual = {"gpu": point(10, 100, 50.0), "hetero": point(10, 100, 95.0)}
            else:
                gain = 1.2 if s.decode_heavy and rate == s.rates[-1] else 1.0
                live = {"gpu": point(rate * 0.9), "hetero": point(rate * 0.9 * gain)}
                virtual = {"gpu": point(rate), "hetero": point(rate * gain)}
            out.append(Cell(s, rate, virtual, live))
    return out


def test_the_table_and_targets_on_canned_results() -> None:
    canned = cells()
    canned[0].live = {"gpu": point(1.0), "hetero": point(0.9)}  # hetero harms here
    table = format_table(canned)
    assert table.count("\n") == len(canned) + 1
    assert "| s0-00-a10-xeon-prompt-heavy | a10-xeon | prompt-heavy | 3072 -> 128 |" in table
    assert "| 0.900x" not in table and "| 0.90x |" in table
    assert "256 -> 2048 * |" in table
    assert "50 tok/s (100%) | 100 tok/s (100%) | 2.00x" in table
    verdicts = {t.name.split(":")[0]: t for t in targets(canned)}
    assert verdicts["coverage"].met
    assert verdicts["no harm"].met is False
    assert "0.90x at s0-00-a10-xeon-prompt-heavy rate 0.6" in verdicts["no harm"].worst
    assert verdicts["decode-heavy"].met and "1.20x" in verdicts["decode-heavy"].worst
    assert verdicts["mixed"].met and "2.00x" in verdicts["mixed"].worst
    # Virtual is 1/0.9 of live (11 %) but 0.6 against 1.0 in the first cell: 40 %.
    assert verdicts["virtual vs live goodput within 10% on the matrix"].met is False
    assert "40% at s0-00" in verdicts["virtual vs live goodput within 10% on the matrix"].worst


def test_mixed_below_interactive_target_and_virtual_only() -> None:
    canned = [c for c in cells() if c.scenario.mixed]
    for c in canned:
        assert c.live is not None
        c.live["hetero"] = point(10, 98.0, 500.0)  # never at 99 %: carries nothing
    mixed = next(t for t in targets(canned) if t.name.startswith("mixed"))
    assert mixed.met is False and "hetero 0 tok/s" in mixed.worst
    for c in canned:
        c.live = None
    judged = {t.name.split(":")[0]: t.met for t in targets(canned, "virtual")}
    assert judged["mixed"] is True and judged["no harm"] is None
    doc = json.loads(json.dumps(document(cheap(count=0, mixed=1), canned, {"seed": 0})))
    assert doc["judged_on"] == "virtual" and doc["cells"][0]["live"] is None
    assert doc["scenarios"][0]["traffic"] == "chat-and-batch"
    assert math.isclose(doc["cells"][0]["ratio_virtual"], 95.0 / 50.0)


def test_a_run_lasts_three_lives_of_a_request_at_its_rate() -> None:
    # 2,000 ms + 2,047 x 125 ms = 257.9 s a life; 3 lives at 0.5 req/s = 387 requests.
    assert steady_requests(0.5, 2048, 2000.0, 125.0) == math.ceil(3 * 0.5 * 257.875)
    assert steady_requests(0.01, 128, 1500.0, 100.0) == KNEE_REQUESTS  # never fewer
    s = cheap()[4]
    assert s.requests_at(0.5, 60) == steady_requests(0.5, 2048, 2000.0, 125.0)
    assert s.requests_at(0.5, 1000) == 1000


def test_decode_heavy_gain_is_goodput_at_slo_not_the_best_rate() -> None:
    s = cheap()[4]  # decode-heavy, rates (0.6, 0.8, 1.3, 2.0)
    shape = {  # rate: (GPU-only attainment, hetero attainment)
        0.6: (100.0, 100.0),
        0.8: (95.0, 100.0),
        1.3: (40.0, 92.0),
        2.0: (30.0, 60.0),
    }
    canned = [
        Cell(s, r, {"gpu": point(r * g / 100, g), "hetero": point(r * h / 100, h)}, None)
        for r, (g, h) in shape.items()
    ]
    # GPU-only's best good req/s (0.76 at 0.8) beats its 0.6 at 2.0 req/s, and hetero's
    # 1.2 at 2.0 req/s misses the SLO: at SLO, 1.196 against 0.76.
    verdict = next(t for t in targets(canned, "virtual") if t.name.startswith("decode-heavy"))
    assert verdict.met and "1.57x" in verdict.worst
    canned[2].virtual["hetero"] = point(1.3 * 0.8, 80.0)  # now hetero's best is 0.8 too
    verdict = next(t for t in targets(canned, "virtual") if t.name.startswith("decode-heavy"))
    assert verdict.met is False and "1.05x" in verdict.worst
