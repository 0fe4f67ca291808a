"""PD through the router on a pair of engines with the SyshaxShmConnector: two real vLLM
engines, then two simulators (the ``engines`` fixture's kinds), with the same assertions.

At temperature 0 the same model gives the same tokens on both engines, and the KV the CPU
engine loads is the GPU engine's own, so a PD answer must equal the gpu-only answer token
for token; the decode engine's own counters prove it used the transferred KV.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.realengine.conftest import (
    FORCED_PD,
    LEASE_SECONDS,
    Pair,
    router_story,
    segments,
    wait_engines_idle,
)
from tests.router.router_procs import Proc, metric, wait_for

PROMPT = "the cache engine router policy node card memory shared segment lease"
MESSAGES = [{"role": "user", "content": "the prefill decode token cache engine"}]


def _body(chat: bool, stream: bool, max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    if chat:
        body["messages"] = MESSAGES
    else:
        body["prompt"] = PROMPT
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def ask(
    url: str, body: dict[str, Any], mode: str | None = None, client: httpx.Client | None = None
) -> dict[str, Any]:
    """Text, token ids, usage and route of one answer (streamed answers reassembled), on
    ``client``'s open connections when given (a new one costs a loaded machine dearly)."""
    http: Any = client if client is not None else httpx
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"X-Syshax-Mode": mode} if mode else {}
    text, ids, usage = "", [], None
    if not body.get("stream"):
        r = http.post(url + path, json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return {
            "route": r.headers.get("x-syshax-route"),
            "text": text,
            "ids": choice.get("token_ids"),
            "usage": data["usage"],
            "finish": choice["finish_reason"],
        }
    finish = None
    with http.stream("POST", url + path, json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        route = r.headers.get("x-syshax-route")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta", {}).get("content") or "") if chat else choice["text"]
                ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
    return {"route": route, "text": text, "ids": ids, "usage": usage, "finish": finish}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_pd_equals_gpu_only_token_for_token(
    engines: Pair, router: Proc, chat: bool, stream: bool
) -> None:
    hits_before = engines.cpu.metric("vllm:external_prefix_cache_hits_total")
    kv_before = metric(router, "syshax_router_kv_transfers_total", outcome="hit")
    gpu_only = ask(router.url, _body(chat, stream), mode="gpu-only")
    pd = ask(router.url, _body(chat, stream))
    assert gpu_only["route"] == "gpu-only" and pd["route"] == "pd"
    assert len(gpu_only["ids"]) == 40
    assert pd["ids"] == gpu_only["ids"]
    assert pd["text"] == gpu_only["text"]
    assert pd["finish"] == gpu_only["finish"] == "length"
    # Usage from the engines' own counts: exact, as the gpu-only answer reports it.
    assert pd["usage"]["completion_tokens"] == gpu_only["usage"]["completion_tokens"] == 40
    assert pd["usage"]["prompt_tokens"] == gpu_only["usage"]["prompt_tokens"]
    # The proof: the decode engine loaded every prompt token through the connector.
    hits_after = engines.cpu.metric("vllm:external_prefix_cache_hits_total")
    injected = hits_after - hits_before
    # One row of the KV-use proof table (docs/kv-connector.md); shown with pytest -s.
    print(
        f"\nkv-proof api={'chat' if chat else 'completions'} stream={stream} "
        f"prompt_tokens={pd['usage']['prompt_tokens']} injected={injected:g} "
        f"external_hits {hits_before:g} -> {hits_after:g}"
    )
    assert injected == pd["usage"]["prompt_tokens"]
    assert metric(router, "syshax_router_kv_transfers_total", outcome="hit") == kv_before + 1
    assert not segments(engines.shm), "the segment is released once loaded"


def test_openai_client_streams_a_pd_answer(router: Proc) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reference = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Syshax-Mode": "gpu-only"},
    )
    assert text == reference.choices[0].message.content


def _detokenize(engine_url: str, ids: list[int]) -> str:
    r = httpx.post(engine_url + "/detokenize", json={"model": "tiny", "tokens": ids}, timeout=30)
    r.raise_for_status()
    return str(r.json()["prompt"])


def assert_spliced(gpu_url: str, text: str, ids: list[int], at: int, total: int) -> None:
    """The answer of a sequence that moved to the GPU after ``at`` tokens is one answer:
    its text is exactly its tokens' text (nothing duplicated or lost at the seam), the part
    before the move is the gpu-only answer, and the rest is the GPU's own continuation of
    exactly those token ids."""
    assert text == _detokenize(gpu_url, ids)
    reference = ask(gpu_url, _body(chat=False, stream=False, max_tokens=at))
    assert ids[:at] == reference["ids"]
    prompt_ids = httpx.post(
        gpu_url + "/tokenize", json={"model": "tiny", "prompt": PROMPT}, timeout=30
    ).json()["tokens"]
    tail = ask(
        gpu_url,
        {
            "model": "tiny",
            "prompt": prompt_ids + ids[:at],
            "max_tokens": total - at,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert ids[at:] == tail["ids"]


def _moved_after(router: Proc, since: int) -> int:
    log = router.log_path.read_text(errors="replace")[since:]
    for line in log.splitlines():
        if "moves to the GPU after" in line or "resuming on the GPU" in line:
            return int(line.split(" after ")[1].split()[0])
    raise AssertionError("the router did not move the sequence:\n" + router_story(router, since))


def test_chunk_boundary_moves_the_sequence_to_the_gpu(engines: Pair, router: Proc) -> None:
    """A live policy change (offload off) lands at the next chunk boundary: the rest of the
    answer comes from the GPU, continued from the exact token ids, nothing repeated."""
    policy: Path = router.policy  # type: ignore[attr-defined]
    since = len(router.log_path.read_text(errors="replace"))
    # A sequence stays on the CPU while the GPU is unavailable to the router (an ejection
    # after an earlier test's provoked errors lasts seconds): start from healthy engines.
    wait_engines_idle(router)
    body = _body(chat=False, stream=True, max_tokens=1800)
    text, ids, usage = "", [], None
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text += choice["text"]
                ids += choice.get("token_ids") or []
                if ids and "gpu-only" not in policy.read_text():
                    # At the first token, and told at once (SIGHUP, not the file poll): the
                    # CPU engine must still be decoding when the change lands, on a loaded
                    # machine too. It moves at the next chunk boundary after the reload.
                    policy.write_text(json.dumps({"mode": "gpu-only"}))
                    router.signal(signal.SIGHUP)
    policy.write_text(json.dumps(FORCED_PD))
    moved = _moved_after(router, since)
    assert 0 < moved < 1800
    assert usage is not None and usage["completion_tokens"] == len(ids) == 1800
    assert_spliced(engines.gpu.url, text, ids, moved, 1800)
    wait_for(lambda: metric(router, "syshax_router_decode_chunks_total", device="gpu") >= 1)


def test_lease_frees_a_transfer_whose_decode_never_comes(engines: Pair) -> None:
    """A prefill whose client left before the decode: the segment lives until its lease."""
    r = httpx.post(
        engines.gpu.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=60,
    )
    params = r.json()["kv_transfer_params"]
    segment = engines.shm / params["segment"]
    assert segment.exists()
    assert params["lease_expires_at"] - time.time() <= LEASE_SECONDS + 1
    wait_for(lambda: not segment.exists(), timeout=LEASE_SECONDS + 10, interval=0.2)


def _prefill(engines: Pair) -> dict[str, Any]:
    r = httpx.post(
        engines.gpu.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "return_token_ids": True,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=60,
    )
    return dict(r.json())


def _decode(engines: Pair, prefill: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    choice = prefill["choices"][0]
    r = httpx.post(
        engines.cpu.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": choice["prompt_token_ids"] + choice["token_ids"],
            "max_tokens": 8,
            "temperature": 0,
            "kv_transfer_params": params,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize(
    "spoil,cause",
    [
        (lambda p: {**p, "producer_engine_id": "gpu-of-another-deployment"}, "was produced by"),
        (lambda p: {**p, "ipc_namespace": "ipc:[1]"}, "IPC namespace"),
        (lambda p: {**p, "transfer_id": "0" * 32}, "not found"),
        (lambda p: {**p, "lease_expires_at": int(time.time()) - 5}, "expired"),
    ],
    ids=["other-engine", "other-namespace", "missing", "expired"],
)
def test_an_unusable_transfer_is_recomputed_and_named(
    engines: Pair, spoil: Any, cause: str
) -> None:
    prefill = _prefill(engines)
    params = {
        k: v
        for k, v in prefill["kv_transfer_params"].items()
        if k != "remote_prefill_cached_tokens"
    }
    hits = engines.cpu.metric("vllm:external_prefix_cache_hits_total")
    log_from = len(engines.cpu.log_text())
    answer = _decode(engines, prefill, spoil(params))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] < params["num_tokens"]
    assert engines.cpu.metric("vllm:external_prefix_cache_hits_total") == hits
    new_log = engines.cpu.log_text()[log_from:]
    assert "SyshaxShmConnector cpu" in new_log and cause in new_log, new_log[-3000:]
    # The good segment is still there for its lease, then reaped: nothing leaks.
    segment = engines.shm / params["segment"]
    wait_for(lambda: not segment.exists(), timeout=LEASE_SECONDS + 10, interval=0.2)


# A prompt long enough that a few transfers of it fill the tier's arenas (vLLM's: 384 KiB of
# 4 MiB each; the simulator's 7B preset: 17 MiB of 64 MiB).
LONG_PROMPT = " ".join([PROMPT] * 25)


def test_a_full_arena_falls_back_to_the_gpu_and_is_counted(engines: Pair, router: Proc) -> None:
    """Prefills whose decodes never come hold the arena for their lease; a PD request then
    cannot publish its KV, is decoded on the GPU that prefilled it, answers exactly as
    gpu-only does, and the router counts the fallback. When the leases end, PD resumes."""
    wait_engines_idle(router)
    body = {**_body(chat=False, stream=False), "prompt": LONG_PROMPT}
    reference = ask(router.url, body, mode="gpu-only")
    held = 0
    for _ in range(40):
        r = httpx.post(
            engines.gpu.url + "/v1/completions",
            json={"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 1,
                  "kv_transfer_params": {"do_remote_decode": True}},
            timeout=60,
        )  # fmt: skip
        params = r.json()["kv_transfer_params"]
        if "syshax_kv_fallback" in params:
            break
        held += 1
    else:
        raise AssertionError("40 held transfers never filled the arena")
    assert held >= 1 and "arena full" in params["syshax_kv_fallback"]
    fallbacks = metric(router, "syshax_router_kv_transfers_total", outcome="fallback")
    hits = metric(router, "syshax_router_kv_transfers_total", outcome="hit")
    pd = ask(router.url, body)
    assert pd["route"] == "pd" and pd["ids"] == reference["ids"]
    assert metric(router, "syshax_router_kv_transfers_total", outcome="fallback") == fallbacks + 1
    assert metric(router, "syshax_router_kv_transfers_total", outcome="hit") == hits
    # The held transfers' leases end, the reaper unlinks them, their slabs come back.
    wait_for(lambda: not segments(engines.shm), timeout=LEASE_SECONDS + 10, interval=0.2)
    again = ask(router.url, body)
    assert again["ids"] == reference["ids"]
    assert metric(router, "syshax_router_kv_transfers_total", outcome="hit") == hits + 1
