"""Every decision path through a real router and real simulated engines (openai client)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from router_procs import MODEL, Proc, metric

PROMPT = [{"role": "user", "content": "tell me about heterogeneous inference please"}]


def client(router: Proc, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=router.url + "/v1", api_key=kw.pop("api_key", "x"), max_retries=0, timeout=30, **kw
    )


def stream_chat(
    router: Proc, max_tokens: int, api_key: str = "x", **extra: Any
) -> tuple[str, list[Any], str]:
    """Returns (route header, chunks, joined text) of one streamed chat completion."""
    with client(router, api_key=api_key).chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=PROMPT,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    ) as raw:
        route = raw.headers.get("x-syshax-route", "")
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return route, chunks, text


def assert_one_continuous_stream(chunks: list[Any], max_tokens: int) -> None:
    assert len({c.id for c in chunks}) == 1, "every chunk carries the same id"
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert len(roles) == 1 and chunks[0] is roles[0], "one role chunk, first"
    tokens = [c for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == len(tokens) == max_tokens
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_gpu_only_streams_the_engine_bytes(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only")
    route, chunks, text = stream_chat(router, 12)
    assert route == "gpu-only"
    assert_one_continuous_stream(chunks, 12)
    assert len(text.split()) == 12
    assert metric(router, "syshax_router_requests_total", decision="gpu-only", outcome="ok") == 1
    assert metric(router, "syshax_router_time_to_first_token_seconds_count") == 1


def test_forced_pd_prefills_on_gpu_and_decodes_on_cpu(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "forced-pd")
    cpu_before = metric(cpu, "vllm:generation_tokens_total")
    route, chunks, _ = stream_chat(router, 20)
    assert route == "pd"
    assert_one_continuous_stream(chunks, 20)
    # The first token came from the GPU prefill, the other 19 from the CPU decode.
    assert metric(cpu, "vllm:generation_tokens_total") - cpu_before == 19
    # One CPU stream, with a re-decision point every token_limit (10) tokens: 2 windows.
    assert metric(router, "syshax_router_decode_chunks_total", device="cpu") == 2


def test_pd_non_streaming_completion_has_one_usage(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "forced-pd")
    raw = client(router).completions.with_raw_response.create(
        model=MODEL, prompt="one two three four", max_tokens=15
    )
    assert raw.headers["x-syshax-route"] == "pd"
    result = raw.parse()
    assert result.choices[0].finish_reason == "length"
    assert len(result.choices[0].text.split()) == 15
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (4, 15)


def test_pd_without_max_tokens_stops_naturally(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "forced-pd")
    result = client(router).completions.create(model=MODEL, prompt="short answer")
    assert result.choices[0].finish_reason in {"stop", "length"}
    assert result.usage is not None
    assert result.usage.completion_tokens == len(result.choices[0].text.split())


def test_chunked_decode_redecides_and_keeps_one_stream(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    """syshax-threshold offloads past max_num_seqs and decodes in token_limit chunks."""
    gpu, cpu = engines
    router = router_factory(
        gpu.url,
        cpu.url,
        "--algorithm",
        "syshax-threshold",
        "--max-num-seqs",
        "1",
        "--token-limit-min",
        "5",
        "--token-limit-max",
        "5",
        "--gpu-cache-threshold",
        "100",
    )
    # max_num_seqs 1 with nothing running still fits on the GPU ...
    assert stream_chat(router, 4)[0] == "gpu-only"
    # ... but a second sequence while one runs is offloaded.
    with client(router).chat.completions.with_streaming_response.create(
        model=MODEL, messages=PROMPT, max_tokens=3000, stream=True
    ) as first:
        lines = first.iter_lines()  # kept referenced: a collected iterator closes the stream
        next(lines)
        route, chunks, _ = stream_chat(router, 23)
    assert route == "pd"
    assert_one_continuous_stream(chunks, 23)
    # 1 prefill token + 22 decoded in chunks of 5: 5 CPU segments.
    assert metric(router, "syshax_router_decode_chunks_total", device="cpu") == 5


def test_cpu_only_mode_never_touches_the_gpu(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "cpu-only")
    gpu_before = metric(gpu, "vllm:generation_tokens_total")
    route, chunks, _ = stream_chat(router, 6)
    assert route == "cpu-only"
    assert_one_continuous_stream(chunks, 6)
    assert metric(gpu, "vllm:generation_tokens_total") == gpu_before


def test_saturation_answers_429_with_retry_after(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(
        gpu.url,
        cpu.url,
        "--max-num-seqs",
        "1",
        "--cpu-max-batch-size",
        "1",
        "--max-queue-size",
        "0",
    )
    c = client(router)
    with c.chat.completions.with_streaming_response.create(
        model=MODEL, messages=PROMPT, max_tokens=3000, stream=True
    ) as on_gpu:
        assert on_gpu.headers["x-syshax-route"] == "gpu-only"
        lines = on_gpu.iter_lines()
        next(lines)
        with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=PROMPT, max_tokens=3000, stream=True
        ) as on_cpu:
            assert on_cpu.headers["x-syshax-route"] == "pd"
            with pytest.raises(openai.RateLimitError) as info:
                c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=5)
    assert info.value.response.headers["retry-after"] == "1"
    error = info.value.response.json()["error"]
    assert error["code"] == "saturated" and "max_queue_size" in error["message"]
    assert metric(router, "syshax_router_requests_total", decision="rejected") == 1


def test_vllm_protocol_pd(engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "forced-pd", "--pd-protocol", "vllm")
    cpu_before = metric(cpu, "vllm:generation_tokens_total")
    hits_before = metric(cpu, "vllm:external_prefix_cache_hits_total")
    route, chunks, _ = stream_chat(router, 10)
    assert route == "pd"
    assert_one_continuous_stream(chunks, 10)
    # The GPU's prefill gave the first token; the CPU decoded the other nine from the
    # transferred KV (its prompt: the prompt's token ids plus that first token).
    assert metric(cpu, "vllm:generation_tokens_total") - cpu_before == 9
    assert metric(cpu, "vllm:external_prefix_cache_hits_total") > hits_before
    assert metric(router, "syshax_router_kv_transfers_total", outcome="hit") == 1


def test_models_health_metrics_and_proxy(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url)
    assert [m.id for m in client(router).models.list()] == [MODEL]
    health = router.get("/health").json()
    assert health["status"] == "ok" and health["algorithm"] == "capacity"
    assert {b["role"] for b in health["backends"]} == {"gpu", "cpu"}
    text = router.get("/metrics").text
    for name in (
        "syshax_router_policy_version",
        "syshax_router_policy_age_seconds",
        "syshax_router_backend_up",
    ):
        assert name in text
    # Any other path goes to the GPU engine, as sysHAX does.
    version = router.get("/version")
    assert version.status_code == 200 and version.json() == gpu.get("/version").json()


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{bad json", 400, "not valid JSON"),
        (json.dumps({"messages": PROMPT}).encode(), 400, "'model' is required"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "'messages' must be"),
        (
            json.dumps({"model": MODEL, "messages": PROMPT, "max_tokens": "9"}).encode(),
            400,
            "'max_tokens' must be an integer",
        ),
        (json.dumps({"model": "nope", "messages": PROMPT}).encode(), 404, "'nope' does not exist"),
        (
            json.dumps({"model": MODEL, "messages": PROMPT, "pad": "x" * 3000}).encode(),
            413,
            "limit",
        ),
    ],
)
def test_bad_input_gets_a_named_openai_error(
    engines: tuple[Proc, Proc],
    router_factory: Callable[..., Proc],
    body: bytes,
    status: int,
    needle: str,
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--max-body-bytes", "2KB")
    resp = httpx.post(
        router.url + "/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"]
    assert "Traceback" not in resp.text


def test_openai_client_sees_typed_errors(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--api-key", "sekrit")
    with pytest.raises(openai.AuthenticationError):
        client(router, api_key="wrong").models.list()
    with pytest.raises(openai.NotFoundError) as info:
        client(router, api_key="sekrit").chat.completions.create(model="other", messages=PROMPT)
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client(router, api_key="sekrit").completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    ok = client(router, api_key="sekrit").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    assert router.get("/health").status_code == 200  # health needs no key


def test_engine_refusals_pass_through_and_do_not_count_against_it(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only")
    with pytest.raises(openai.BadRequestError) as info:
        client(router).chat.completions.create(model=MODEL, messages=PROMPT, n=2)
    assert info.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client(router).completions.create(model=MODEL, prompt="x", max_tokens=10_000_000)
    # vLLM 0.32's own wording, relayed unchanged.
    assert "cannot be greater than max_model_len" in long.value.message
    assert metric(router, "syshax_router_backend_errors_total") == 0
    assert metric(router, "syshax_router_requests_total", outcome="client_error") == 2
    assert router.get("/health").json()["backends"][0]["up"]


def test_the_mode_header_forces_a_policy_mode_per_request(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    """Benchmarks run CPU, GPU and hetero mode through one router on the same engines
    (with a benchmark key: test_router_access.py has who else may)."""
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only", "--benchmark-key", "bench")
    for forced, route in (("cpu-only", "cpu-only"), ("forced-pd", "pd"), ("gpu-only", "gpu-only")):
        seen, chunks, _ = stream_chat(router, 6, "bench", extra_headers={"X-Syshax-Mode": forced})
        assert seen == route, forced
        assert_one_continuous_stream(chunks, 6)
    bad = httpx.post(
        router.url + "/v1/chat/completions",
        headers={"X-Syshax-Mode": "turbo", "Authorization": "Bearer bench"},
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 2},
        timeout=10,
    )
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "X-Syshax-Mode" and "turbo" in error["message"]


def test_the_mode_header_can_be_switched_off(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(
        gpu.url, cpu.url, "--mode", "gpu-only", "--no-mode-header", "--benchmark-key", "bench"
    )
    seen, _, _ = stream_chat(router, 4, "bench", extra_headers={"X-Syshax-Mode": "cpu-only"})
    assert seen == "gpu-only"
