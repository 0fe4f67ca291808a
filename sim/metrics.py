"""Prometheus exposition with vLLM's metric names, current (V1) and legacy (0.4-0.6) sets.

Durations are in simulated seconds, so a dashboard shows the same latencies whatever
``--speed`` the engine runs at; throughputs are tokens per simulated second.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from sim.engine import SimEngine
    from sim.stats import Histogram

MetricsMode = Literal["current", "legacy", "both"]
LABELS = ["model_name", "engine"]


class EngineCollector(Collector):
    def __init__(self, engine: SimEngine, mode: MetricsMode) -> None:
        self.engine = engine
        self.current = mode in ("current", "both")
        self.legacy = mode in ("legacy", "both")

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        sched = engine.scheduler
        stats = engine.stats
        labels = [engine.config.served_model_name, engine.config.engine_id]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            m = HistogramMetricFamily(name, doc, labels=LABELS)
            m.add_metric(labels, h.cumulative(), h.sum)
            return m

        # Shared by both generations of vLLM.
        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", len(sched.running)
        )
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting)
        )
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", stats.prompt_tokens_total)
        yield counter(
            "vllm:generation_tokens", "Generation tokens processed.", stats.generation_tokens_total
        )
        yield histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", stats.ttft
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", stats.e2e
        )
        if self.current:
            yield self._cache_config_info()
            yield gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                sched.kv_usage(),
            )
            yield counter(
                "vllm:num_preemptions", "Cumulative number of preemptions.", sched.preemptions_total
            )
            yield histogram(
                "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", stats.itl
            )
            yield counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_cache_queries_total,
            )
            yield counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_cache_hits_total,
            )
            yield counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache "
                "sharing, in terms of number of queried tokens.",
                stats.external_prefix_cache_queries_total,
            )
            yield counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.",
                stats.external_prefix_cache_hits_total,
            )
            yield counter(
                "vllm:prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).",
                stats.prompt_tokens_cached_total,
            )
            success = CounterMetricFamily(
                "vllm:request_success",
                "Count of successfully processed requests.",
                labels=[*LABELS, "finished_reason"],
            )
            for reason in ("stop", "length", "abort"):
                success.add_metric([*labels, reason], stats.requests_finished.get(reason, 0))
            yield success
        if self.legacy:
            device_usage = sched.kv_usage()
            yield gauge(
                "vllm:gpu_cache_usage_perc",
                "Device KV-cache usage (a CPU engine reports its KV space here, as vLLM's CPU "
                "backend does). 1 means 100 percent usage.",
                device_usage,
            )
            yield gauge(
                "vllm:cpu_cache_usage_perc",
                "Swap-space KV usage. 1 means 100 percent usage.",
                sched.swap_usage(),
            )
            yield gauge("vllm:num_requests_swapped", "Requests swapped to CPU.", len(sched.swapped))
            prompt_tps, gen_tps = stats.throughputs(engine.sim_now())
            yield gauge(
                "vllm:avg_prompt_throughput_toks_per_s",
                "Average prefill throughput in tokens/s over the last 5 s.",
                prompt_tps,
            )
            yield gauge(
                "vllm:avg_generation_throughput_toks_per_s",
                "Average generation throughput in tokens/s over the last 5 s.",
                gen_tps,
            )
            yield histogram(
                "vllm:time_per_output_token_seconds",
                "Time per output token in seconds.",
                stats.itl,
            )

    def _cache_config_info(self) -> GaugeMetricFamily:
        """vLLM's ``vllm:cache_config_info``: the KV cache's settings as labels (those the
        simulator has; a router reads ``block_size`` and ``enable_prefix_caching``)."""
        config = self.engine.config
        info = {
            "block_size": str(config.block_size),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_gpu_blocks": str(self.engine.capacity.num_blocks),
        }
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        family.add_metric(list(info.values()), 1.0)
        return family


def build_registry(
    engine: SimEngine, mode: MetricsMode, log_stats: bool = True
) -> CollectorRegistry:
    """The engine's metrics; none at all without ``log_stats`` (vLLM's --disable-log-stats)."""
    registry = CollectorRegistry(auto_describe=False)
    if log_stats:
        registry.register(EngineCollector(engine, mode))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
