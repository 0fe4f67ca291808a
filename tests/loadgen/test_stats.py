"""The statistics follow vLLM's bench-serve definitions; these pin them on hand-made records."""

from __future__ import annotations

import pytest

from loadgen.records import RequestRecord
from loadgen.stats import SLO, distribution, error_counts, percentile, ratio, summarize


def record(
    index: int,
    chunks: list[float],
    *,
    sent: float = 0.0,
    ok: bool = True,
    error: str = "",
    prompt_tokens: int = 10,
    usage: int | None = None,
) -> RequestRecord:
    r = RequestRecord(index, prompt_tokens, len(chunks), sent_at=sent, chunk_times=list(chunks))
    r.ok, r.error, r.usage_output_tokens = ok, error, usage
    return r


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_is_in_milliseconds() -> None:
    d = distribution([0.1, 0.2, 0.3])
    assert d.count == 3
    assert d.mean == pytest.approx(200.0)
    assert d.median == pytest.approx(200.0)
    assert d.min == pytest.approx(100.0) and d.max == pytest.approx(300.0)
    assert d.std == pytest.approx(81.6496, rel=1e-4)
    empty = distribution([])
    assert empty.count == 0 and empty.mean is None and empty.p99 is None


def test_request_metrics_follow_vllm() -> None:
    # sent at 1.0; chunks at 1.1, 1.15, 1.3: TTFT 0.1, E2E 0.3, TPOT (0.3 - 0.1) / 2.
    r = record(0, [1.1, 1.15, 1.3], sent=1.0)
    assert r.ttft == pytest.approx(0.1)
    assert r.latency == pytest.approx(0.3)
    assert r.tpot == pytest.approx(0.1)
    assert r.itl == pytest.approx([0.05, 0.15])


def test_tpot_uses_the_servers_token_count_when_it_reports_one() -> None:
    # Two chunks but the usage chunk says 5 tokens (several tokens per chunk).
    r = record(0, [1.0, 2.0], usage=5)
    assert r.output_tokens == 5
    assert r.tpot == pytest.approx(1.0 / 4)


def test_one_token_answer_has_zero_tpot_and_no_tpot_sample() -> None:
    r = record(0, [0.5])
    assert r.tpot == 0.0
    summary = summarize([r], 1.0)
    assert summary.tpot.count == 0
    assert summary.ttft.count == 1


def test_summary_counts_failures_and_excludes_them_from_latency() -> None:
    good = [record(i, [0.1, 0.2, 0.3]) for i in range(3)]
    bad = record(3, [], ok=False, error="HTTP 500: boom\ntraceback")
    cut = record(4, [0.1], ok=False, error="ClientPayloadError: cut")
    summary = summarize([*good, bad, cut], duration_s=2.0)
    assert summary.requests == 5
    assert summary.completed == 3
    assert summary.failed == 2
    assert summary.errors == {"HTTP 500: boom": 1, "ClientPayloadError: cut": 1}
    assert summary.ttft.count == 3  # the cut request's chunk is not a sample
    assert summary.total_output_tokens == 9
    assert summary.total_input_tokens == 30
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.output_throughput == pytest.approx(4.5)
    assert summary.total_token_throughput == pytest.approx(19.5)
    assert summary.itl.count == 6  # two gaps per request, pooled
    assert summary.goodput is None


def test_goodput_needs_every_slo() -> None:
    fast = record(0, [0.05, 0.06, 0.07])  # TTFT 50 ms, TPOT 10 ms, E2E 70 ms
    slow_first = record(1, [0.5, 0.51, 0.52])  # TTFT 500 ms
    slow_tokens = record(2, [0.05, 0.25, 0.45])  # TPOT 200 ms
    failed = record(3, [], ok=False, error="x")
    records = [fast, slow_first, slow_tokens, failed]
    both = summarize(records, 2.0, SLO(ttft_ms=100, tpot_ms=50))
    assert both.good_requests == 1
    assert both.goodput == pytest.approx(0.5)
    ttft_only = summarize(records, 2.0, SLO(ttft_ms=100))
    assert ttft_only.good_requests == 2
    e2e_only = summarize(records, 1.0, SLO(e2e_ms=70))  # the bound is inclusive
    assert e2e_only.good_requests == 1
    # Why each missed: the first target it fails, in TTFT, TPOT, E2E order.
    slo = SLO(ttft_ms=100, tpot_ms=50)
    assert [slo.missed(r) for r in records] == ["", "ttft", "tpot", "error"]
    assert SLO(e2e_ms=60).missed(fast) == "e2e"


def test_slo_rejects_non_positive_bounds() -> None:
    with pytest.raises(ValueError):
        SLO(ttft_ms=0)


def test_summary_needs_a_positive_duration() -> None:
    with pytest.raises(ValueError):
        summarize([], 0.0)


def test_error_counts_most_frequent_first() -> None:
    records = [record(i, [], ok=False, error=e) for i, e in enumerate(["b", "a", "a", ""])]
    assert list(error_counts(records).items()) == [("a", 2), ("b", 1), ("unknown error", 1)]


def test_ratio_handles_missing_and_zero() -> None:
    assert ratio(6.0, 3.0) == 2.0
    assert ratio(None, 3.0) is None
    assert ratio(1.0, 0.0) is None


def test_time_scale_reports_simulated_time() -> None:
    # A simulator at --speed 4 ran this in a quarter of the time.
    r = record(0, [1.025, 1.05, 1.075], sent=1.0)
    summary = summarize([r], 0.1, time_scale=4.0)
    assert summary.ttft.mean == pytest.approx(100.0)
    assert summary.tpot.mean == pytest.approx(100.0)
    assert summary.e2e.mean == pytest.approx(300.0)
    assert summary.duration_s == pytest.approx(0.4)
    assert summary.output_throughput == pytest.approx(3 / 0.4)
    assert r.chunk_times == [1.025, 1.05, 1.075]  # the record itself is untouched
    with pytest.raises(ValueError):
        summarize([r], 1.0, time_scale=0.0)
