"""/metrics parsed with prometheus_client's own text parser."""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_procs import MODEL, SimFactory, SimProcess

CURRENT = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_cached",
    "vllm:request_success",
}
LEGACY = {
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:num_requests_swapped",
    "vllm:avg_generation_throughput_toks_per_s",
    "vllm:avg_prompt_throughput_toks_per_s",
}


def scrape(sim: SimProcess) -> dict[str, dict[str, float]]:
    """family name -> {sample name + sorted labels: value}, checking every sample's labels."""
    text = httpx.get(f"{sim.url}/metrics").text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        samples: dict[str, float] = {}
        if family.name == "vllm:cache_config_info":
            # vLLM's settings gauge: the settings as labels, no model_name (as in vLLM).
            assert family.samples[0].labels["enable_prefix_caching"] in ("True", "False")
            continue
        for s in family.samples:
            assert s.labels["model_name"] == MODEL
            assert s.labels["engine"]
            extra = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            samples[f"{s.name}{{{extra}}}"] = s.value
        out[family.name] = samples
    return out


def test_both_families_by_default_with_labels(gpu_sim: SimProcess) -> None:
    names = set(scrape(gpu_sim))
    assert names >= CURRENT
    assert names >= LEGACY


@pytest.mark.parametrize(
    ("mode", "present", "absent"),
    [
        ("current", CURRENT, LEGACY),
        ("legacy", LEGACY, {"vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"}),
    ],
)
def test_metrics_flag_selects_the_family(
    sim_factory: SimFactory, mode: str, present: set[str], absent: set[str]
) -> None:
    sim = sim_factory("--device", "a100-80gb", "--model", MODEL, "--metrics", mode)
    names = set(scrape(sim))
    assert present <= names
    assert not (absent & names)


def test_disable_log_stats_serves_no_engine_metrics_like_vllm(sim_factory: SimFactory) -> None:
    sim = sim_factory("--device", "a100-80gb", "--model", MODEL, "--disable-log-stats")
    response = httpx.get(f"{sim.url}/metrics")
    assert response.status_code == 200 and "vllm:" not in response.text


def test_counters_and_histograms_follow_requests(sim_factory: SimFactory) -> None:
    sim = sim_factory(
        "--device", "a100-80gb", "--model", MODEL, "--speed", "20", "--engine-id", "gpu-7"
    )
    before = scrape(sim)
    assert before["vllm:generation_tokens"]["vllm:generation_tokens_total{}"] == 0
    for _ in range(3):
        httpx.post(
            f"{sim.url}/v1/completions", json={"prompt": "a b c d", "max_tokens": 10}, timeout=30
        )
    after = scrape(sim)
    assert after["vllm:prompt_tokens"]["vllm:prompt_tokens_total{}"] == 12
    # No local prefix cache is modelled: every prompt token is a query and none a hit.
    assert after["vllm:prefix_cache_queries"]["vllm:prefix_cache_queries_total{}"] == 12
    assert after["vllm:prefix_cache_hits"]["vllm:prefix_cache_hits_total{}"] == 0
    success = after["vllm:request_success"]
    assert success["vllm:request_success_total{finished_reason=length}"] == 3
    assert after["vllm:generation_tokens"]["vllm:generation_tokens_total{}"] == 30
    ttft = after["vllm:time_to_first_token_seconds"]
    assert ttft["vllm:time_to_first_token_seconds_count{}"] == 3
    # Durations are simulated seconds: a 4-token prefill of a 32B q4_0 model on an A100 is
    # a weight-bound step of ~12 ms whatever --speed says.
    assert 0.005 < ttft["vllm:time_to_first_token_seconds_sum{}"] / 3 < 0.05
    itl = after["vllm:inter_token_latency_seconds"]
    assert itl["vllm:inter_token_latency_seconds_count{}"] == 27
    assert 0.005 < itl["vllm:inter_token_latency_seconds_sum{}"] / 27 < 0.05
    assert (
        after["vllm:e2e_request_latency_seconds"]["vllm:e2e_request_latency_seconds_count{}"] == 3
    )
    assert (
        after["vllm:avg_generation_throughput_toks_per_s"][
            "vllm:avg_generation_throughput_toks_per_s{}"
        ]
        > 0
    )
    engine_label = httpx.get(f"{sim.url}/metrics").text
    assert 'engine="gpu-7"' in engine_label


def test_gauges_show_a_busy_engine(sim_factory: SimFactory) -> None:
    # max_num_seqs 2 with 5 long requests in flight: 2 running, 3 waiting, KV in use.
    sim = sim_factory("--device", "kunpeng-920-7280z", "--model", MODEL, "--max-num-seqs", "2")

    def request() -> None:
        # The engine is stopped mid-request at the end of the test; that error is expected.
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{sim.url}/v1/completions",
                json={"prompt": "x " * 100, "max_tokens": 400},
                timeout=60,
            )

    threads = [threading.Thread(target=request, daemon=True) for _ in range(5)]
    for t in threads:
        t.start()
    seen: dict[str, dict[str, float]] = {}
    for _ in range(100):
        seen = scrape(sim)
        running = seen["vllm:num_requests_running"]["vllm:num_requests_running{}"]
        if (running, seen["vllm:num_requests_waiting"]["vllm:num_requests_waiting{}"]) == (2, 3):
            break
        threading.Event().wait(0.05)
    assert seen["vllm:num_requests_running"]["vllm:num_requests_running{}"] == 2
    assert seen["vllm:num_requests_waiting"]["vllm:num_requests_waiting{}"] == 3
    assert seen["vllm:kv_cache_usage_perc"]["vllm:kv_cache_usage_perc{}"] > 0
    assert seen["vllm:gpu_cache_usage_perc"]["vllm:gpu_cache_usage_perc{}"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_full_kv_cache_preempts_and_every_stream_still_completes(
    sim_factory: SimFactory, mode: str
) -> None:
    # 0.05 GiB of CPU KV holds 200 tokens of the 32B model: not enough for 4 x (40 + 100).
    sim = sim_factory(
        "--device", "kunpeng-920-7280z", "--model", MODEL, "--speed", "20",
        "--kv-cache-space", "0.05", "--max-model-len", "150",
        *(["--syshax-compat", "--preemption-mode", mode] if mode == "swap" else []),
    )  # fmt: skip
    results: list[int] = []

    def request() -> None:
        r = httpx.post(
            f"{sim.url}/v1/completions",
            json={"prompt": "w " * 40, "max_tokens": 100, "stream": False},
            timeout=120,
        )
        results.append(r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=request) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [100] * 4
    after = scrape(sim)
    assert after["vllm:num_preemptions"]["vllm:num_preemptions_total{}"] > 0
    assert after["vllm:num_requests_running"]["vllm:num_requests_running{}"] == 0
    assert after["vllm:kv_cache_usage_perc"]["vllm:kv_cache_usage_perc{}"] == 0
    assert after["vllm:cpu_cache_usage_perc"]["vllm:cpu_cache_usage_perc{}"] == 0
