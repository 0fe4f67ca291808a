"""Parse an engine's Prometheus ``/metrics`` text into the few numbers the deciders need.

Pure functions only. The scrape (``router.engines.scrape``) parses each answer here; each
``Backend`` keeps two consecutive samples (``LoadTracker``) and turns counters into rates with
:func:`derive_load`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# vLLM renamed several metrics (V1); both spellings are read so either engine generation works.
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc")
_GEN_TOKENS = ("vllm:generation_tokens_total",)
_ITL_SUM = ("vllm:inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum")
_ITL_COUNT = ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count")
_AVG_GEN = ("vllm:avg_generation_throughput_toks_per_s",)
# The ITL histogram's buckets: the median gap of an interval is a decode step's time, which
# the few gaps a prefill step stretches do not move (the mean is moved by them).
_ITL_BUCKET = (
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
)
# Prefill: prompt tokens (computed or cached), the cached ones, and the time to first token.
# A prompt whose KV was handed over (a PD decode) is counted as cached where the engine says
# so; where it does not, its short TTFT still adds time and no computed tokens.
_PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
_PROMPT_CACHED = ("vllm:prompt_tokens_cached_total",)
_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
_TTFT_SUM = ("vllm:time_to_first_token_seconds_sum",)
_TTFT_COUNT = ("vllm:time_to_first_token_seconds_count",)

WANTED_METRICS = frozenset(
    _RUNNING
    + _WAITING
    + _KV_USAGE
    + _GEN_TOKENS
    + _ITL_SUM
    + _ITL_COUNT
    + _AVG_GEN
    + _ITL_BUCKET
    + _PROMPT_TOKENS
    + _PROMPT_CACHED
    + _PREFIX_HITS
    + _TTFT_SUM
    + _TTFT_COUNT
)


@dataclass(frozen=True)
class EngineSample:
    """One scrape. ``None`` means the engine does not export that metric."""

    at: float
    running: float
    waiting: float
    kv_usage: float  # fraction 0..1
    generation_tokens: float | None
    itl_sum: float | None
    itl_count: float | None
    avg_generation_tps: float | None
    # The ITL histogram: (upper bound in seconds, cumulative count), by bound; () if absent.
    itl_buckets: tuple[tuple[float, float], ...] = ()
    # Prompt tokens computed (not served from a cache) and the TTFT histogram's sum and count.
    computed_prompt_tokens: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None


@dataclass(frozen=True)
class DeviceLoad:
    """What a decider knows about one engine at decision time."""

    available: bool
    running: int
    waiting: int
    kv_usage_perc: float  # 0..100, like sysHAX's gpu_cache_usage * 100
    throughput_tps: float  # generation tokens/s over the last scrape interval
    itl_ms: float | None  # mean inter-token latency over the last interval, None if unknown
    # Sequences running when ``itl_ms`` was measured (the scraped gauge), None if unknown.
    itl_batch: float | None = None
    # The median inter-token gap over the last interval: what a decode step takes, without
    # the gaps a prefill step stretched (None: the engine exports no ITL histogram).
    decode_itl_ms: float | None = None
    # Time to first token per computed prompt token over the last interval with a prefill
    # (kept across intervals without one), None if never measured: TTFT includes the queue
    # and prefills batched together, so it overstates the prefill time, on purpose.
    prefill_ms_per_token: float | None = None
    # The latest scrape failed (timed out, unreadable) or the sample is too old: its numbers
    # say little about the engine now, so the decider sends it no new decode.
    stale: bool = False


UNAVAILABLE = DeviceLoad(False, 0, 0, 0.0, 0.0, None)


def device_load(
    sample: EngineSample | None,
    inflight: int,
    throughput_tps: float,
    itl_ms: float | None,
    decode_itl_ms: float | None = None,
    prefill_ms_per_token: float | None = None,
) -> DeviceLoad:
    """What a decider sees of an available engine: its last scrape, with the router's own
    in-flight count where that is higher (it is fresher between scrapes)."""
    scraped_running = int(sample.running) if sample else 0
    return DeviceLoad(
        available=True,
        running=max(scraped_running, inflight),
        waiting=int(sample.waiting) if sample else 0,
        kv_usage_perc=100.0 * sample.kv_usage if sample else 0.0,
        throughput_tps=throughput_tps,
        itl_ms=itl_ms,
        itl_batch=sample.running if sample else None,
        decode_itl_ms=decode_itl_ms,
        prefill_ms_per_token=prefill_ms_per_token,
    )


def parse_metrics_text(text: str, at: float) -> EngineSample:
    """Sum each wanted metric over its label sets (one engine may serve several model names)."""
    sums: dict[str, float] = {}
    buckets: dict[float, float] = {}
    bucket_family = ""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        end = brace if 0 <= brace < space else space
        name = line[:end]
        if name not in WANTED_METRICS:
            continue
        # The value follows the label set (which may contain spaces inside quotes).
        tail = line[line.rfind("}") + 1 :] if brace >= 0 else line[space:]
        parts = tail.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if name in _ITL_BUCKET:
            if bucket_family not in ("", name):
                continue  # one family: vLLM V1's, or an older engine's
            bucket_family = name
            bound = _le(line, brace)
            if bound is not None:
                buckets[bound] = buckets.get(bound, 0.0) + value
            continue
        sums[name] = sums.get(name, 0.0) + value

    def first(names: tuple[str, ...]) -> float | None:
        for name in names:
            if name in sums:
                return sums[name]
        return None

    kv = first(_KV_USAGE)
    prompt = first(_PROMPT_TOKENS)
    cached = first(_PROMPT_CACHED)
    if cached is None:
        cached = sum(sums.get(name, 0.0) for name in _PREFIX_HITS)
    return EngineSample(
        at=at,
        running=first(_RUNNING) or 0.0,
        waiting=first(_WAITING) or 0.0,
        kv_usage=min(1.0, max(0.0, kv or 0.0)),
        generation_tokens=first(_GEN_TOKENS),
        itl_sum=first(_ITL_SUM),
        itl_count=first(_ITL_COUNT),
        avg_generation_tps=first(_AVG_GEN),
        itl_buckets=tuple(sorted(buckets.items())),
        computed_prompt_tokens=max(0.0, prompt - cached) if prompt is not None else None,
        ttft_sum=first(_TTFT_SUM),
        ttft_count=first(_TTFT_COUNT),
    )


def _le(line: str, brace: int) -> float | None:
    """The ``le`` label's bound of a histogram bucket line, or None."""
    at = line.find('le="', brace)
    if at < 0:
        return None
    end = line.find('"', at + 4)
    try:
        return float(line[at + 4 : end])  # "+Inf" parses as inf
    except ValueError:
        return None


def median_itl_ms(
    previous: EngineSample | None, current: EngineSample, min_gaps: float = 1.0
) -> float | None:
    """The median inter-token gap (ms) between two scrapes, from the ITL histogram's bucket
    counts: linear within the bucket that holds it, as Prometheus' histogram_quantile does.
    None when either scrape lacks the histogram, their bounds differ, or fewer than
    ``min_gaps`` gaps came."""
    if previous is None or not current.itl_buckets or not previous.itl_buckets:
        return None
    if len(previous.itl_buckets) != len(current.itl_buckets):
        return None
    deltas = []
    for (bound, now), (before_bound, before) in zip(
        current.itl_buckets, previous.itl_buckets, strict=True
    ):
        if bound != before_bound or now < before:
            return None  # another engine, or a restarted one
        deltas.append((bound, now - before))
    total = deltas[-1][1]
    if total <= 0 or total < min_gaps:
        return None
    half = total / 2
    lower, below = 0.0, 0.0
    for bound, cumulative in deltas:
        if cumulative >= half:
            if bound == float("inf"):
                return 1000.0 * lower  # past the last finite bound: its edge, as Prometheus
            within = cumulative - below
            share = (half - below) / within if within > 0 else 1.0
            return 1000.0 * (lower + (bound - lower) * share)
        lower, below = bound, cumulative
    return None


def derive_load(
    previous: EngineSample | None, current: EngineSample, last_itl_ms: float | None
) -> tuple[float, float | None]:
    """Throughput (tokens/s) and mean ITL (ms) between two scrapes.

    With no new tokens in the interval the last known ITL is kept: an idle engine's latency
    did not become unknown, it just was not measured.
    """
    throughput = current.avg_generation_tps or 0.0
    itl_ms = last_itl_ms
    if previous is None:
        return throughput, itl_ms
    dt = current.at - previous.at
    if (
        dt > 0
        and current.generation_tokens is not None
        and previous.generation_tokens is not None
        and current.generation_tokens >= previous.generation_tokens
    ):
        throughput = (current.generation_tokens - previous.generation_tokens) / dt
    if (
        current.itl_sum is not None
        and current.itl_count is not None
        and previous.itl_sum is not None
        and previous.itl_count is not None
    ):
        count = current.itl_count - previous.itl_count
        if count > 0:
            itl_ms = 1000.0 * (current.itl_sum - previous.itl_sum) / count
    return throughput, itl_ms


# An interval measures the prefill only with this many computed prompt tokens per first
# token: fewer are PD decodes whose KV was handed over (the engine recomputes a token or
# so), whose TTFT says nothing about a prefill.
MIN_PROMPT_TOKENS_PER_FIRST = 16


def derive_prefill_ms_per_token(
    previous: EngineSample | None, current: EngineSample, last: float | None
) -> float | None:
    """TTFT per computed prompt token between two scrapes: the TTFT sum's growth over the
    computed prompt tokens' growth. The last value stands through an interval without a
    first token or with only handed-over KV (``MIN_PROMPT_TOKENS_PER_FIRST``), and through
    a restarted engine's counters."""
    if previous is None:
        return last
    pairs = (
        (previous.ttft_sum, current.ttft_sum),
        (previous.ttft_count, current.ttft_count),
        (previous.computed_prompt_tokens, current.computed_prompt_tokens),
    )
    deltas = [b - a for a, b in pairs if a is not None and b is not None]
    if len(deltas) < len(pairs) or min(deltas) < 0:
        return last
    ttft_s, firsts, tokens = deltas
    if firsts <= 0 or tokens < MIN_PROMPT_TOKENS_PER_FIRST * firsts:
        return last
    return 1000.0 * ttft_s / tokens


def fit_itl_slope(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (ms per extra sequence) of ITL against batch size, or None.

    ``samples`` are (running sequences, ITL ms) pairs from recent scrapes. A fit needs
    at least two distinct batch sizes; a negative slope (noise) is clamped to zero.
    """
    if len(samples) < 2:
        return None
    xs = [x for x, _ in samples]
    mean_x = sum(xs) / len(xs)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var <= 0:
        return None
    mean_y = sum(y for _, y in samples) / len(samples)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in samples)
    return max(0.0, cov / var)


MEDIAN_GAPS_PER_STREAM = 2.0


class LoadTracker:
    """What the router keeps of one engine from scrape to scrape: the last sample, the
    throughput and mean ITL between the last two, the decode steps' time (the median gap),
    and the ITL's slope against batch size. The live router's backends and the virtual-time
    model (hetero) keep it alike."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.sample: EngineSample | None = None
        self.throughput_tps = 0.0
        self.itl_ms: float | None = None
        self.decode_itl_ms: float | None = None
        self.itl_samples: deque[tuple[float, float]] = deque(maxlen=30)
        self.itl_slope_ms: float | None = None
        self.prefill_ms_per_token: float | None = None

    def observe(self, sample: EngineSample) -> None:
        self.throughput_tps, self.itl_ms = derive_load(self.sample, sample, self.itl_ms)
        self.prefill_ms_per_token = derive_prefill_ms_per_token(
            self.sample, sample, self.prefill_ms_per_token
        )
        # A prefill step stretches one gap of each stream batched with it: with two gaps a
        # stream, the median is a decode step. An interval one long prefill filled has not
        # that many; the last decode step measured stands.
        streams = max(1.0, sample.running)
        median = median_itl_ms(self.sample, sample, min_gaps=MEDIAN_GAPS_PER_STREAM * streams)
        self.decode_itl_ms = median if median is not None else self.decode_itl_ms
        # The GPU's knee is judged on its decode steps (a prefill in the interval must not
        # read as a steeper slope); the CPU's latency SLO on the mean its streams get.
        knee = self.role == "gpu" and self.decode_itl_ms is not None
        step_ms = self.decode_itl_ms if knee else self.itl_ms
        if step_ms is not None and sample.running > 0:
            self.itl_samples.append((sample.running, step_ms))
            self.itl_slope_ms = fit_itl_slope(list(self.itl_samples))
        self.sample = sample

    def tracked_load(self, inflight: int) -> DeviceLoad:
        return device_load(
            self.sample,
            inflight,
            self.throughput_tps,
            self.itl_ms,
            self.decode_itl_ms,
            self.prefill_ms_per_token,
        )
