"""Benchmark statistics with vLLM's ``vllm bench serve`` definitions. Pure functions, no I/O.

- TTFT: send to the first chunk with content.
- TPOT: (latency - TTFT) / (output tokens - 1), per successful request.
- ITL: every gap between consecutive content chunks, pooled over all requests.
- E2E: send to the last content chunk.
- Throughput: completed requests, output tokens and input + output tokens, over wall time.
- Goodput: completed requests meeting every given SLO, over wall time.
Percentiles interpolate linearly between order statistics (numpy's default), as vLLM's do.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

from loadgen.records import RequestRecord


class Timed(Protocol):
    """What an SLO reads of a request: a live record, or one of the virtual model's."""

    @property
    def ok(self) -> bool: ...
    @property
    def ttft(self) -> float | None: ...
    @property
    def tpot(self) -> float | None: ...
    @property
    def latency(self) -> float | None: ...


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0-100")
    return _percentile_sorted(sorted(values), q)


def _percentile_sorted(ordered: Sequence[float], q: float) -> float:
    """:func:`percentile` of values already sorted ascending (non-empty, ``q`` in 0-100)."""
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Summary of one metric, in milliseconds. Empty metrics have count 0 and None values."""

    count: int
    mean: float | None = None
    median: float | None = None
    std: float | None = None
    p90: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def distribution(seconds: Sequence[float]) -> Distribution:
    """Mean, median, population std, p90, p99, min and max of ``seconds``, in milliseconds."""
    if not seconds:
        return Distribution(count=0)
    values = [value * 1000.0 for value in seconds]
    mean = math.fsum(values) / len(values)
    variance = math.fsum((value - mean) ** 2 for value in values) / len(values)
    ordered = sorted(values)
    return Distribution(
        count=len(values),
        mean=mean,
        median=_percentile_sorted(ordered, 50.0),
        std=math.sqrt(variance),
        p90=_percentile_sorted(ordered, 90.0),
        p99=_percentile_sorted(ordered, 99.0),
        min=min(values),
        max=max(values),
    )


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in milliseconds; None leaves a metric unchecked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and value <= 0:
                raise ValueError(f"SLO {name} must be positive, got {value}")

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    def met_by(self, record: Timed) -> bool:
        """Whether a request succeeded and met every SLO given (a bound is inclusive)."""
        return not self.missed(record)

    def missed(self, record: Timed) -> str:
        """Why a request did not meet the SLOs: ``error``, or the first target it missed
        (``ttft``, ``tpot``, ``e2e``); "" when it met them all."""
        if not record.ok:
            return "error"
        checks = (
            ("ttft", self.ttft_ms, record.ttft),
            ("tpot", self.tpot_ms, record.tpot),
            ("e2e", self.e2e_ms, record.latency),
        )
        for name, bound_ms, value in checks:
            if bound_ms is None:
                continue
            if value is None or value * 1000.0 > bound_ms:
                return name
        return ""


@dataclass(frozen=True)
class Summary:
    """All figures of one run (one mode at one concurrency level)."""

    requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    good_requests: int | None
    goodput: float | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests grouped by the first line of their error, most frequent first."""
    counts = Counter(
        (record.error.strip().splitlines() or ["unknown error"])[0]
        for record in records
        if not record.ok
    )
    return dict(counts.most_common())


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO | None = None,
    *,
    time_scale: float = 1.0,
) -> Summary:
    """Summarize a run's measured (not warm-up) requests over its wall time ``duration_s``.

    ``time_scale`` multiplies every measured duration: a simulator run at ``--speed 4``
    compresses time four-fold, and ``time_scale=4`` reports its figures in simulated time.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    if time_scale <= 0:
        raise ValueError(f"time scale must be positive, got {time_scale}")
    if time_scale != 1.0:
        records = [record.scaled(time_scale) for record in records]
        duration_s *= time_scale
    done = [record for record in records if record.ok]
    ttfts = [value for record in done if (value := record.ttft) is not None]
    e2es = [value for record in done if (value := record.latency) is not None]
    # vLLM keeps TPOT only for answers of more than one token; goodput treats others as 0.
    tpots = [
        value for record in done if record.output_tokens > 1 and (value := record.tpot) is not None
    ]
    itls = [gap for record in done for gap in record.itl]
    input_tokens = sum(record.prompt_tokens for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    good: int | None = None
    goodput: float | None = None
    if slo is not None and not slo.empty:
        good = sum(1 for record in done if slo.met_by(record))
        goodput = good / duration_s
    return Summary(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        errors=error_counts(records),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        good_requests=good,
        goodput=goodput,
        ttft=distribution(ttfts),
        tpot=distribution(tpots),
        itl=distribution(itls),
        e2e=distribution(e2es),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# A mixed run's batch class: its TPOT target as a multiple of the interactive one
# (``--batch-slo-tpot-ms`` overrides it), the low end of "five to ten times slower" and the
# factor of the virtual-time mixed-traffic benchmark (``hetero.mixed.BATCH_TPOT_FACTOR``).
BATCH_TPOT_FACTOR = 5.0
# Its TTFT target: the policy's default for the batch class (common.policy_schema).
BATCH_TTFT_MS = 60000.0


def class_slos(
    classes: Sequence[str],
    interactive: SLO,
    batch_ttft_ms: float | None = None,
    batch_tpot_ms: float | None = None,
) -> dict[str, SLO]:
    """Each class's SLO in a mixed run: ``interactive`` (the run's ``--slo-*`` flags) for
    every class but ``batch``; for batch, TTFT ``batch_ttft_ms`` (default
    :data:`BATCH_TTFT_MS`) and TPOT ``batch_tpot_ms`` (default :data:`BATCH_TPOT_FACTOR` x the
    interactive TPOT), no end-to-end bound. Without an interactive SLO, no class has one, and
    a batch bound alone is refused: goodput is judged for every class or for none."""
    if interactive.empty:
        if batch_ttft_ms is not None or batch_tpot_ms is not None:
            raise ValueError(
                "the batch class's SLO needs the interactive one: give --slo-ttft-ms, "
                "--slo-tpot-ms or --slo-e2e-ms too"
            )
        return {name: SLO() for name in classes}
    if batch_tpot_ms is None and interactive.tpot_ms is not None:
        batch_tpot_ms = BATCH_TPOT_FACTOR * interactive.tpot_ms
    batch = SLO(BATCH_TTFT_MS if batch_ttft_ms is None else batch_ttft_ms, batch_tpot_ms)
    return {name: batch if name == "batch" else interactive for name in classes}


@dataclass(frozen=True)
class ClassSummary:
    """One SLO class's requests of a mixed run, against that class's own SLO."""

    slo_class: str
    service_tier: str
    slo: SLO
    summary: Summary

    @property
    def attainment(self) -> float | None:
        """Percent of the class's requests that succeeded and met its SLO (None: no SLO)."""
        good, requests = self.summary.good_requests, self.summary.requests
        if good is None:
            return None
        return 100.0 * good / requests if requests else 100.0

    def to_dict(self) -> dict[str, object]:
        return {
            "slo_class": self.slo_class,
            "service_tier": self.service_tier,
            "slo_ms": {"ttft": self.slo.ttft_ms, "tpot": self.slo.tpot_ms, "e2e": self.slo.e2e_ms},
            "attainment": self.attainment,
            "summary": self.summary.to_dict(),
        }


def summarize_classes(
    records: Sequence[RequestRecord],
    classes: Mapping[int, str],
    tiers: Mapping[str, str],
    duration_s: float,
    slos: Mapping[str, SLO],
) -> dict[str, ClassSummary]:
    """Per-class figures of a mixed run: ``classes`` gives each request's class by its
    index, ``tiers`` each class's ``service_tier`` in the mix's order (a class that drew no
    request still gets its empty row). Every class is summarized over the run's whole wall
    time ``duration_s``, so the classes' throughputs and goodputs add up to the run's."""
    grouped: dict[str, list[RequestRecord]] = {name: [] for name in tiers}
    for record in records:
        name = classes[record.index]
        grouped.setdefault(name, []).append(record)
    return {
        name: ClassSummary(
            name,
            tiers.get(name, ""),
            slos.get(name, SLO()),
            summarize(group, duration_s, slos.get(name)),
        )
        for name, group in grouped.items()
    }


def combined_goodput(summary: Summary, classes: Mapping[str, ClassSummary]) -> Summary:
    """``summary`` (the whole run's) with its good requests and goodput counted class by
    class, each request against its own class's SLO; unchanged where no class has an SLO."""
    counts = [c.summary.good_requests for c in classes.values()]
    if not counts or any(count is None for count in counts):
        return summary
    good = sum(count or 0 for count in counts)
    return replace(summary, good_requests=good, goodput=good / summary.duration_s)
