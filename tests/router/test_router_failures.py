"""Failures: engines dying or stalling, a client leaving. The client sees a whole stream or an
OpenAI-shaped error, never a hang."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai
import pytest
from router_procs import MODEL, Proc, dead_url, metric, wait_for
from test_router_paths import PROMPT, assert_one_continuous_stream, client, stream_chat


def test_cpu_killed_mid_stream_resumes_on_gpu(
    engines: tuple[Proc, Proc], slow_cpu: Proc, router_factory: Callable[..., Proc]
) -> None:
    gpu, _ = engines
    router = router_factory(gpu.url, slow_cpu.url, "--mode", "forced-pd")
    chunks = []
    with client(router).chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=PROMPT,
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        assert raw.headers["x-syshax-route"] == "pd"
        for chunk in raw.parse():
            chunks.append(chunk)
            if len(chunks) == 15:
                slow_cpu.kill()
    assert_one_continuous_stream(chunks, 120)
    assert metric(router, "syshax_router_fallbacks_total", kind="cpu-decode-to-gpu") == 1
    assert metric(router, "syshax_router_decode_chunks_total", device="gpu") == 1
    assert metric(router, "syshax_router_requests_total", decision="pd", outcome="ok") == 1
    assert metric(router, "syshax_router_decisions_total", stage="new", route="pd", reason="mode")


def test_a_gpu_decode_that_fails_goes_on_on_the_cpu(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    """The GPU kept the prompt's KV (no room for the handoff) and died before its decode: the
    CPU recomputes the prompt and the first token and decodes the rest. One whole stream."""
    from standins import PrefillOnlyEngine

    _, cpu = engines
    gpu = PrefillOnlyEngine()
    try:
        router = router_factory(gpu.url, cpu.url, "--mode", "forced-pd", "--pd-protocol", "vllm")
        chunks = []
        with client(router).completions.with_streaming_response.create(
            model=MODEL,
            prompt="tell me",
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        ) as raw:
            assert raw.headers["x-syshax-route"] == "pd"
            for chunk in raw.parse():
                chunks.append(chunk)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text.startswith(" first")
        (usage,) = [c.usage for c in chunks if c.usage]
        assert usage.completion_tokens == 40 and usage.prompt_tokens == 12
        assert [bool(p.get("stream")) for p in gpu.posts] == [False, True]
    finally:
        gpu.close()
    assert metric(router, "syshax_router_fallbacks_total", kind="gpu-decode-to-cpu") == 1
    assert metric(router, "syshax_router_requests_total", decision="pd", outcome="ok") == 1


def test_stalled_cpu_hits_the_idle_timeout_and_gpu_finishes(
    engines: tuple[Proc, Proc], workdir: object, router_factory: Callable[..., Proc]
) -> None:
    from pathlib import Path

    from router_procs import start_sim

    base = Path(str(workdir))
    # 0.01x: one CPU token every few seconds, far beyond the router's 0.5 s idle timeout.
    stalled = start_sim("stalledcpu", "kunpeng-920-7280z", base, base / "shm", 0.01)
    try:
        gpu, _ = engines
        router = router_factory(
            gpu.url,
            stalled.url,
            "--mode",
            "forced-pd",
            "--idle-timeout",
            "0.5",
            "--eject-base-seconds",
            "30",
        )
        started = time.monotonic()
        route, chunks, _ = stream_chat(router, 30)
        assert time.monotonic() - started < 10
        assert route == "pd"
        assert_one_continuous_stream(chunks, 30)
        assert metric(router, "syshax_router_backend_errors_total", role="cpu") == 1
        # Its metrics still answer, but after three failed decodes the CPU is ejected ...
        for _ in range(2):
            assert stream_chat(router, 5)[0] == "pd"
        assert metric(router, "syshax_router_backend_ejections_total", role="cpu") == 1
        assert router.get("/health").json()["backends"][1]["ejected"]
        # ... and new requests skip it instead of waiting for another timeout.
        assert stream_chat(router, 5)[0] == "gpu-only"
        assert metric(router, "syshax_router_backend_errors_total", role="cpu") == 3

        # A GPU this slow trips the first-byte timeout: a prompt 503, not a hang.
        slow_gpu = router_factory(
            stalled.url, None, "--mode", "gpu-only", "--first-byte-timeout", "0.5"
        )
        started = time.monotonic()
        resp = httpx.post(
            slow_gpu.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x " * 2000, "max_tokens": 3},
            timeout=30,
        )
        assert time.monotonic() - started < 5
        assert resp.status_code == 503 and "Retry-After" in resp.headers
        assert "within 0.5s" in resp.json()["error"]["message"]

        # The whole-request deadline (request_timeout_seconds): a 504 once it passes.
        short = router_factory(
            stalled.url, None, "--mode", "gpu-only", "--request-timeout-seconds", "1"
        )
        started = time.monotonic()
        resp = httpx.post(
            short.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 50},
            timeout=30,
        )
        assert 0.9 < time.monotonic() - started < 5
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "request_timeout"
        assert metric(short, "syshax_router_requests_total", outcome="error") == 1
    finally:
        stalled.stop()


def test_cpu_down_before_the_request_falls_back_to_gpu(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, _ = engines
    router = router_factory(gpu.url, dead_url(), "--mode", "forced-pd")
    wait_for(lambda: not router.get("/health").json()["backends"][1]["up"])
    route, chunks, _ = stream_chat(router, 8)
    assert route == "gpu-only"
    assert_one_continuous_stream(chunks, 8)
    assert metric(router, "syshax_router_fallbacks_total") == 1


def test_gpu_down_serves_cpu_only_when_policy_allows(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    _, cpu = engines
    router = router_factory(dead_url(), cpu.url)
    wait_for(lambda: not router.get("/health").json()["backends"][0]["up"])
    route, chunks, _ = stream_chat(router, 6)
    assert route == "cpu-only"
    assert_one_continuous_stream(chunks, 6)


def test_gpu_down_in_gpu_only_mode_is_503_with_retry_after(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    _, cpu = engines
    router = router_factory(dead_url(), cpu.url, "--mode", "gpu-only")
    # Even before the first scrape noticed, a refused connect must not hang or leak a trace.
    with pytest.raises(openai.InternalServerError) as info:
        client(router).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "backend_unavailable"  # type: ignore[index]


@pytest.mark.process
def test_everything_down_is_503_and_health_says_so(router_factory: Callable[..., Proc]) -> None:
    router = router_factory(dead_url(), dead_url())
    wait_for(lambda: router.get("/health").status_code == 503)
    resp = httpx.post(
        router.url + "/v1/completions",
        timeout=10,
        json={"model": MODEL, "prompt": "x", "max_tokens": 3},
    )
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    assert resp.json()["error"]["type"] == "service_unavailable"


def test_client_disconnect_cancels_upstream(
    engines: tuple[Proc, Proc], slow_cpu: Proc, router_factory: Callable[..., Proc]
) -> None:
    gpu, _ = engines
    router = router_factory(gpu.url, slow_cpu.url, "--mode", "forced-pd")
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": MODEL,
            "messages": PROMPT,
            "max_tokens": 2000,
            "stream": True,
        },
    ) as resp:
        lines = resp.iter_lines()
        for _ in range(10):
            next(lines)
        assert metric(slow_cpu, "vllm:num_requests_running") == 1
    # The client is gone: the CPU decode must stop, not run its 2000 tokens to the end.
    wait_for(lambda: metric(slow_cpu, "vllm:num_requests_running") == 0, timeout=3)
    wait_for(lambda: metric(router, "syshax_router_requests_total", outcome="cancelled") == 1)
    assert all(b["inflight"] == 0 for b in router.get("/health").json()["backends"])


def test_client_disconnect_cancels_a_passthrough_stream_and_a_waiting_request(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only")
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 6000}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", timeout=30, json={**body, "stream": True}
    ) as resp:
        lines = resp.iter_lines()
        for _ in range(10):
            next(lines)
        assert metric(gpu, "vllm:num_requests_running") == 1
    wait_for(lambda: metric(gpu, "vllm:num_requests_running") == 0, timeout=1.5)
    # A non-streaming client that gives up while the engine is still generating.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.url + "/v1/chat/completions", json=body, timeout=0.3)
    wait_for(lambda: metric(gpu, "vllm:num_requests_running") == 0, timeout=1.5)
    wait_for(lambda: metric(router, "syshax_router_requests_total", outcome="cancelled") == 2)


def test_gpu_down_with_a_cpu_admitting_none_is_503_not_cpu_only(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    # cpu_max_batch_size 0: the policy lets the CPU serve nothing, and a failed GPU does not
    # change that, neither before the first scrape notices (the fallback path) nor after.
    _, cpu = engines
    router = router_factory(dead_url(), cpu.url, "--cpu-max-batch-size", "0")
    for attempt in ("before the scrape", "after it"):
        resp = httpx.post(
            router.url + "/v1/completions",
            timeout=10,
            json={"model": MODEL, "prompt": "x", "max_tokens": 3},
        )
        assert resp.status_code == 503, (attempt, resp.text)
        assert resp.json()["error"]["code"] == "backend_unavailable", attempt
        wait_for(lambda: not router.get("/health").json()["backends"][0]["up"])
    assert metric(router, "syshax_router_requests_total", decision="cpu-only") == 0
