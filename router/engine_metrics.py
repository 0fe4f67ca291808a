"""Parse an engine's Prometheus ``/metrics`` text into the few numbers the deciders need.

Pure functions only. The scrape loop in ``backends.py`` keeps two consecutive samples and
turns counters into rates with :func:`derive_load`.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM renamed several metrics (V1); both spellings are read so either engine generation works.
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc")
_GEN_TOKENS = ("vllm:generation_tokens_total",)
_ITL_SUM = ("vllm:inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum")
_ITL_COUNT = ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count")
_AVG_GEN = ("vllm:avg_generation_throughput_toks_per_s",)

WANTED_METRICS = frozenset(
    _RUNNING + _WAITING + _KV_USAGE + _GEN_TOKENS + _ITL_SUM + _ITL_COUNT + _AVG_GEN
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


UNAVAILABLE = DeviceLoad(False, 0, 0, 0.0, 0.0, None)


def device_load(
    sample: EngineSample | None, inflight: int, throughput_tps: float, itl_ms: float | None
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
    )


def parse_metrics_text(text: str, at: float) -> EngineSample:
    """Sum each wanted metric over its label sets (one engine may serve several model names)."""
    sums: dict[str, float] = {}
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
        sums[name] = sums.get(name, 0.0) + value

    def first(names: tuple[str, ...]) -> float | None:
        for name in names:
            if name in sums:
                return sums[name]
        return None

    kv = first(_KV_USAGE)
    return EngineSample(
        at=at,
        running=first(_RUNNING) or 0.0,
        waiting=first(_WAITING) or 0.0,
        kv_usage=min(1.0, max(0.0, kv or 0.0)),
        generation_tokens=first(_GEN_TOKENS),
        itl_sum=first(_ITL_SUM),
        itl_count=first(_ITL_COUNT),
        avg_generation_tps=first(_AVG_GEN),
    )


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
