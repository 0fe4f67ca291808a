"""Usage is tokens, not chunks (issue 38): what the client is told and what the tenant is
charged, on passthrough, PD in both protocols, a CPU decode that dies and resumes on the GPU,
and ``n > 1``, when the engines' stream chunks carry several tokens each. In-process: a router
in front of recording engines, no child process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from recording_engine import PROMPT_IDS, RecordingEngine
from router_procs import MODEL

from common.policy_schema import PolicyKnobs
from common.routing import DeploymentSpec
from common.tenants import TenantRecord, hash_key
from router.api.app import build_app
from router.state import PolicyRecord, Router, ServerConfig

KEY = "sk-shx-acme-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FORCED_PD = PolicyKnobs(mode="forced-pd", token_limit_min=8, token_limit_max=8)

Client = TestClient[web.Request, web.Application]


@pytest.fixture
def pair() -> Iterator[tuple[RecordingEngine, RecordingEngine]]:
    gpu, cpu = RecordingEngine(), RecordingEngine()
    yield gpu, cpu
    gpu.close()
    cpu.close()


def router_for(
    gpu: RecordingEngine, cpu: RecordingEngine, knobs: PolicyKnobs, protocol: str = "vllm"
) -> Router:
    router = Router(ServerConfig(api_key="router-key"))
    router.tenants.set_records([TenantRecord("acme", key_hashes=frozenset({hash_key(KEY)}))])
    router.state.set_policy(PolicyRecord("default", 1, knobs))
    router.state.set_deployments(
        [
            DeploymentSpec(
                id=1,
                name="d",
                model=MODEL,
                policy="default",
                pd_protocol=protocol,
                gpu_url=gpu.url,
                cpu_url=cpu.url,
            )
        ]
    )
    return router


def run(router: Router, check: Callable[[Client], Awaitable[None]]) -> None:
    async def go() -> None:
        async with TestClient(TestServer(build_app(router))) as client:
            await check(client)
        await router.state.close()

    asyncio.run(go())


async def stream(client: Client, path: str, body: dict[str, Any]) -> tuple[str, list[dict]]:
    """(route header, the stream's chunks) of one streamed request."""
    answer = await client.post(path, json={**body, "stream": True}, headers=AUTH)
    assert answer.status == 200, await answer.text()
    raw = (await answer.read()).decode()
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    return answer.headers["X-Syshax-Route"], chunks


def text_of(chunks: list[dict], index: int = 0) -> str:
    out = ""
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if choice["index"] == index:
                out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


def charged(router: Router) -> tuple[int, int]:
    usage = router.tenants.take_usage()["acme"]
    assert usage["requests"] == 1
    return usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("chat", [False, True])
def test_a_passthrough_stream_without_a_usage_chunk_is_charged_its_tokens(
    pair: tuple[RecordingEngine, RecordingEngine], chat: bool
) -> None:
    """Four tokens an upstream chunk: the tenant pays 40 tokens, not 10 chunks."""
    gpu, cpu = pair
    gpu.tokens_per_chunk = 4
    router = router_for(gpu, cpu, PolicyKnobs(mode="gpu-only"))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {}

    async def check(client: Client) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, **prompt}
        route, chunks = await stream(client, path, body)
        assert route == "gpu-only" and text_of(chunks).split() == ["tok"] * 40

    run(router, check)
    assert charged(router)[1] == 40


@pytest.mark.parametrize("protocol", ["vllm", "syshax"])
def test_a_pd_stream_of_multi_token_chunks_reports_its_tokens(
    pair: tuple[RecordingEngine, RecordingEngine], protocol: str
) -> None:
    gpu, cpu = pair
    gpu.tokens_per_chunk = cpu.tokens_per_chunk = 3
    router = router_for(gpu, cpu, FORCED_PD, protocol)

    async def check(client: Client) -> None:
        body = {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 50,
            "stream_options": {"include_usage": True},
        }
        route, chunks = await stream(client, "/v1/completions", body)
        assert route == "pd"
        assert text_of(chunks).split() == ["tok"] * 50
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 50 and usage["prompt_tokens"] == len(PROMPT_IDS)

    run(router, check)
    assert charged(router) == (len(PROMPT_IDS), 50)


@pytest.mark.parametrize(
    ("protocol", "continuous"),
    # sysHAX's engines send no token ids: a cut segment is counted by its per-chunk usage.
    [("vllm", False), ("vllm", True), ("syshax", True)],
)
def test_a_pd_stream_whose_cpu_dies_resumes_on_the_gpu_with_exactly_max_tokens(
    pair: tuple[RecordingEngine, RecordingEngine], protocol: str, continuous: bool
) -> None:
    """The CPU engine dies after three chunks of four tokens; the GPU decodes the rest. The
    client sees max_tokens completion tokens and its prompt once (the GPU's re-prefill of
    prompt plus text so far is the router's cost), and the tenant is charged the same."""
    gpu, cpu = pair
    gpu.tokens_per_chunk = cpu.tokens_per_chunk = 4
    cpu.die_after = 3
    cpu.continuous_usage = gpu.continuous_usage = continuous
    router = router_for(gpu, cpu, PolicyKnobs(mode="forced-pd"), protocol)

    async def check(client: Client) -> None:
        body = {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 60,
            "stream_options": {"include_usage": True},
        }
        route, chunks = await stream(client, "/v1/completions", body)
        assert route == "pd"
        assert text_of(chunks).split() == ["tok"] * 60
        assert chunks[-1]["usage"] == {
            "prompt_tokens": len(PROMPT_IDS),
            "completion_tokens": 60,
            "total_tokens": len(PROMPT_IDS) + 60,
        }

    run(router, check)
    streamed = [s.body for s in cpu.requests() + gpu.requests() if (s.body or {}).get("stream")]
    assert len(streamed) == 2, "the CPU's cut decode, then the GPU's"
    assert charged(router) == (len(PROMPT_IDS), 60)


def test_n_choices_sum_their_tokens(pair: tuple[RecordingEngine, RecordingEngine]) -> None:
    """n = 3 (a passthrough: PD serves one choice): the engine's usage sums the choices, and
    without one the tenant is charged every choice's tokens, not its chunks."""
    gpu, cpu = pair
    gpu.tokens_per_chunk = 2
    router = router_for(gpu, cpu, PolicyKnobs(mode="gpu-only"))

    async def check(client: Client) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "n": 3}
        _, chunks = await stream(
            client, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
        assert [len(text_of(chunks, i).split()) for i in range(3)] == [20, 20, 20]
        assert chunks[-1]["usage"]["completion_tokens"] == 60
        assert charged(router)[1] == 60
        await stream(client, "/v1/completions", body)
        assert charged(router)[1] == 60

    run(router, check)
