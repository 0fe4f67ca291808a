"""A mixed scenario in the live load generator: classes drawn by share and sent as
``service_tier``, each class reported against its own SLO, and the CLI's checks. Nothing
here starts a process (tests/loadgen/test_mixed_live.py runs it against a router)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from loadgen import cli
from loadgen.records import RequestRecord
from loadgen.report import Row, format_class_slos, format_classes, to_json
from loadgen.scenarios import MIXED_SCENARIOS, SCENARIOS, ClassShare, MixedScenario
from loadgen.stats import (
    BATCH_TTFT_MS,
    SLO,
    class_slos,
    combined_goodput,
    summarize,
    summarize_classes,
)
from loadgen.workload import WARMUP_INDEX, build_mixed_requests

MIX = MIXED_SCENARIOS["chat-and-batch"]
TIERS = {"interactive": "priority", "batch": "flex"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


# Requests by share, each carrying its class's service_tier


def test_each_request_carries_its_classs_service_tier_in_the_mixs_proportions() -> None:
    lopsided = MixedScenario(
        "mostly-chat",
        (
            ClassShare("interactive", SCENARIOS["short"], 0.8),
            ClassShare("batch", SCENARIOS["medium"], 0.2),
        ),
    )
    specs = cli._specs(SCENARIOS["short"], lopsided, 1000, seed=7)
    assert specs == build_mixed_requests(1000, lopsided, 7)  # the CLI draws as the workload does
    tiers = Counter(spec.service_tier for spec in specs)
    assert 750 <= tiers["priority"] <= 850 and tiers["priority"] + tiers["flex"] == 1000
    classes = cli.request_classes(specs)
    for spec in specs:
        name = classes[spec.index]
        assert spec.service_tier == TIERS[name]
        shape = lopsided.for_class(name)
        assert (spec.prompt_tokens, spec.max_tokens) == (shape.input_tokens, shape.output_tokens)
    # Warm-up requests of a mixed run are mixed too, with indexes of their own.
    warmup = cli._specs(SCENARIOS["short"], lopsided, 8, seed=8, first_index=WARMUP_INDEX)
    assert all(spec.index >= WARMUP_INDEX and spec.service_tier for spec in warmup)
    # A run of one shape sends no service_tier.
    plain = cli._specs(SCENARIOS["short"], None, 4, seed=7)
    assert all(spec.service_tier is None for spec in plain)


def test_a_mixed_run_spans_its_classes_concurrency_ranges() -> None:
    stand_in = cli._mix_scenario(MIX)
    assert stand_in.concurrency_levels == (1, 2, 4, 8, 16)  # short 1-16, medium 1-8
    assert "interactive 50% (service_tier priority, 128 -> 256 tokens)" in cli._describe_mix(MIX)


# Per-class figures from synthetic records


def record(index: int, ttft: float, tpot: float, tokens: int, ok: bool = True) -> RequestRecord:
    """A request sent at 0 whose first chunk came at ``ttft`` and each next at ``tpot``."""
    r = RequestRecord(index, 8, tokens, sent_at=0.0)
    if ok:
        r.chunk_times = [ttft + i * tpot for i in range(tokens)]
        r.usage_output_tokens = tokens
        r.ok = True
        r.status = 200
    else:
        r.error = "HTTP 503: overloaded"
        r.status = 503
    return r


def synthetic() -> tuple[list[RequestRecord], dict[int, str]]:
    # Interactive: TTFT 0.1-0.4 s, TPOT 20 ms, one of them at 90 ms (over a 50 ms bound).
    interactive = [
        record(0, 0.1, 0.020, 11),
        record(2, 0.2, 0.020, 11),
        record(4, 0.3, 0.090, 11),
        record(6, 0.4, 0.020, 11),
    ]
    # Batch: TPOT 200 ms meets 5 x 50 = 250 ms; 300 ms does not; one failed.
    batch = [
        record(1, 2.0, 0.200, 21),
        record(3, 3.0, 0.300, 21),
        record(5, 0.0, 0.0, 21, ok=False),
    ]
    records = sorted(interactive + batch, key=lambda r: r.index)
    classes = {r.index: ("interactive" if r.index % 2 == 0 else "batch") for r in records}
    return records, classes


def test_the_batch_class_is_judged_by_its_own_looser_slo() -> None:
    slos = class_slos(["interactive", "batch"], SLO(1000.0, 50.0))
    assert slos["interactive"] == SLO(1000.0, 50.0)
    assert slos["batch"] == SLO(BATCH_TTFT_MS, 250.0)  # the class default, 5 x the TPOT
    assert class_slos(["batch"], SLO(1000.0, 50.0), 9000.0, 400.0)["batch"] == SLO(9000.0, 400.0)
    assert class_slos(["interactive", "batch"], SLO()) == {
        "interactive": SLO(),
        "batch": SLO(),
    }
    with pytest.raises(ValueError, match="needs the interactive one"):
        class_slos(["batch"], SLO(), batch_tpot_ms=400.0)


def test_per_class_figures_from_synthetic_records() -> None:
    records, classes = synthetic()
    slos = class_slos(["interactive", "batch"], SLO(1000.0, 50.0))
    figures = summarize_classes(records, classes, TIERS, 10.0, slos)
    assert list(figures) == ["interactive", "batch"]

    interactive = figures["interactive"]
    s = interactive.summary
    assert (s.requests, s.completed, s.failed) == (4, 4, 0)
    assert s.ttft.median == pytest.approx(250.0)  # 100, 200, 300, 400 ms
    assert s.ttft.p99 == pytest.approx(397.0)
    assert s.tpot.median == pytest.approx(20.0)
    assert s.tpot.p99 == pytest.approx(90.0 - 0.03 * 70.0)  # 20, 20, 20, 90 ms
    assert s.good_requests == 3 and s.goodput == pytest.approx(0.3)
    assert interactive.attainment == pytest.approx(75.0)
    assert interactive.service_tier == "priority"

    batch = figures["batch"]
    b = batch.summary
    assert (b.requests, b.completed, b.failed) == (3, 2, 1)
    assert b.tpot.median == pytest.approx(250.0) and b.ttft.median == pytest.approx(2500.0)
    assert b.good_requests == 1 and b.goodput == pytest.approx(0.1)
    assert batch.attainment == pytest.approx(100.0 / 3)
    assert b.errors == {"HTTP 503: overloaded": 1}

    # The whole row's goodput counts each request against its own class's SLO.
    whole = combined_goodput(summarize(records, 10.0), figures)
    assert whole.good_requests == 4 and whole.goodput == pytest.approx(0.4)
    assert whole.requests == 7 and whole.total_output_tokens == 4 * 11 + 2 * 21
    # Without SLOs the classes still get their latencies, and no goodput anywhere.
    bare = summarize_classes(records, classes, TIERS, 10.0, class_slos(list(TIERS), SLO()))
    assert bare["batch"].attainment is None and bare["batch"].summary.goodput is None
    assert combined_goodput(summarize(records, 10.0), bare).goodput is None


def test_a_class_that_drew_no_request_still_has_its_row() -> None:
    records, _ = synthetic()
    only_interactive = {r.index: "interactive" for r in records}
    figures = summarize_classes(records, only_interactive, TIERS, 10.0, {})
    assert figures["batch"].summary.requests == 0
    assert figures["batch"].summary.ttft.count == 0


def test_the_report_and_json_carry_the_per_class_section() -> None:
    records, classes = synthetic()
    slos = class_slos(["interactive", "batch"], SLO(1000.0, 50.0))
    figures = summarize_classes(records, classes, TIERS, 10.0, slos)
    summary = combined_goodput(summarize(records, 10.0), figures)
    row = Row(
        "target", 4, "http://r", "m", summary, records, classes=figures, request_classes=classes
    )
    plain = Row("target", 4, "http://r", "m", summarize(records, 10.0), records)

    table = format_classes([row, plain])
    lines = table.splitlines()
    assert lines[0].startswith("| mode | concurrency | class | service_tier | ok / failed")
    assert "| target | 4 | interactive | priority | 4 / 0 |" in table
    assert "| 4.4 | 250.0 | 397.0 | 20.0 | 87.9 | 75.0% | 0.30 |" in table
    assert "| target | 4 | batch | flex | 2 / 1 |" in table
    assert "| 33.3% | 0.10 |" in table
    assert len(lines) == 4  # the plain row adds none
    assert format_classes([plain]) == ""
    assert format_class_slos([row]) == (
        "interactive: TTFT <= 1000 ms, TPOT <= 50 ms; batch: TTFT <= 60000 ms, TPOT <= 250 ms"
    )

    document = json.loads(json.dumps(to_json({}, [row, plain], samples=True)))
    mixed, single = document["rows"]
    assert "classes" not in single
    assert "slo_class" not in single["requests"][0]
    section = mixed["classes"]
    assert list(section) == ["interactive", "batch"]
    assert section["batch"]["service_tier"] == "flex"
    assert section["batch"]["slo_ms"] == {"ttft": 60000.0, "tpot": 250.0, "e2e": None}
    assert section["batch"]["summary"]["requests"] == 3
    assert section["interactive"]["attainment"] == pytest.approx(75.0)
    assert section["interactive"]["summary"]["goodput"] == pytest.approx(0.3)
    assert [s["slo_class"] for s in mixed["requests"]] == [classes[i] for i in range(7)]
    assert mixed["failed_requests"][0]["slo_class"] == "batch"
    assert mixed["summary"]["good_requests"] == 4


# The CLI's checks


def test_an_unknown_scenario_is_refused_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("--scenario", "chat-and-nothing", "--target", "http://127.0.0.1:1")
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "chat-and-nothing" in error
    for name in ("short", "custom", "chat-and-batch"):
        assert name in error
    # The same check where the arguments were built without the parser.
    args = parse("--target", "http://127.0.0.1:1")
    args.scenario = "chat-and-nothing"
    with pytest.raises(ValueError, match=r"unknown scenario 'chat-and-nothing' \(known: ") as info:
        cli._mixed_scenario(args)
    assert "custom, chat-and-batch)" in str(info.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "chat-and-batch", "--output-tokens", "8"], "its own shape"),
        (
            ["--scenario", "chat-and-batch", "--request-rate", "1,2", "--slo-ttft-ms", "100"],
            "goodput_sweep.py --mixed",
        ),
        (["--scenario", "chat-and-batch", "--batch-slo-tpot-ms", "400"], "needs the interactive"),
        (["--scenario", "short", "--batch-slo-tpot-ms", "400"], "need a mixed scenario"),
    ],
)
def test_mixed_runs_refuse_what_does_not_apply(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused before any request: the target is a closed port.
    args = parse(*argv, "--target", "http://127.0.0.1:1", "--no-progress")
    assert cli.run(args) == 2
    assert message in capsys.readouterr().err


# goodput_sweep.py --mixed


def test_goodput_sweep_mixed_runs_the_mixed_traffic_script(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = Path(__file__).resolve().parents[2] / "scripts" / "bench"
    spec = importlib.util.spec_from_file_location("goodput_sweep", bench / "goodput_sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.syspath_prepend(str(bench))
    import mixed_traffic  # the module goodput_sweep.py --mixed imports

    seen: list[list[str]] = []

    def fake_main() -> int:
        seen.append(list(sys.argv))
        return 0

    monkeypatch.setattr(mixed_traffic, "main", fake_main)
    assert module.main(["--mixed", "--pair", "a10-xeon", "--quick"]) == 0
    assert seen == [["goodput_sweep.py --mixed", "--pair", "a10-xeon", "--quick"]]
