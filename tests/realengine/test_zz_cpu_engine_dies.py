"""An engine is killed in the middle of a stream: the client gets one continuous answer.

This module kills the package's shared CPU engine, so it is named to run last (of each engine
kind: pytest runs every test of one kind of the ``engines`` fixture before the next kind).

The client kills the engine once it has read a little of the answer. The router writes to
the client as fast as the engine produces, and vLLM's API server can itself fall seconds
behind its engine core on a busy machine, so a client read late can find the whole answer
already sent: its kill then lands on an idle engine and tests nothing. Such an attempt is
recognised (the router saw no upstream failure), discarded, and the engine restarted; it is
never counted as a pass, and three in a row fail the test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from testbed.vllm_env import EngineProcess
from tests.realengine.conftest import FORCED_PD, Pair
from tests.realengine.test_pd import MESSAGES, PROMPT, _body, _moved_after, ask, assert_spliced
from tests.router.router_procs import Proc, metric, wait_for

TOTAL = 1200
ATTEMPTS = 3
T = TypeVar("T")


def _killed_mid_answer(
    engine: EngineProcess, router: Proc, stream: Callable[[], T]
) -> tuple[T, int]:
    """Run ``stream`` (a request whose client kills ``engine`` part-way through reading the
    answer) until the router saw the engine fail under it; return its result and the offset
    in the router's log where that attempt began."""
    for _ in range(ATTEMPTS):
        since = len(router.log_path.read_text(errors="replace"))
        result = stream()
        if "upstream failure: " in router.log_path.read_text(errors="replace")[since:]:
            return result, since
        # The engine had sent everything before it died: restart it and try again.
        if not engine.alive():
            engine.restart()
        wait_for(lambda: metric(router, "syshax_router_backend_up", role=engine.name) == 1, 30)
    raise AssertionError(f"in {ATTEMPTS} attempts the {engine.name} engine always finished first")


def test_gpu_only_stream_resumes_on_the_cpu_when_its_engine_dies(
    engines: Pair, router: Proc
) -> None:
    """A passthrough stream (offload on, but sysHAX's threshold decider keeps an idle GPU's
    requests on the GPU) whose GPU engine dies: the router re-tokenizes the text relayed so
    far on the CPU engine and decodes on from there, under the same id, nothing repeated."""
    policy: Path = router.policy  # type: ignore[attr-defined]
    policy.write_text(
        json.dumps(
            {"mode": "auto", "enable_auto_pd_offload": True, "algorithm": "syshax-threshold"}
        )
    )
    time.sleep(1.0)  # the router reads its policy file every 250 ms
    body = _body(chat=True, stream=True, max_tokens=TOTAL)
    del body["return_token_ids"]  # a plain client: the router relays the engine's bytes

    def stream() -> tuple[str, set[str], dict | None, list[dict]]:
        text, ids_seen, usage, errors = "", set(), None, []
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.headers["x-syshax-route"] == "gpu-only"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk)
                    continue
                ids_seen.add(chunk["id"])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text += choice.get("delta", {}).get("content") or ""
                    if len(text) >= 40 and engines.gpu.alive():
                        engines.gpu.kill()
        return text, ids_seen, usage, errors

    try:
        (text, ids_seen, usage, errors), since = _killed_mid_answer(engines.gpu, router, stream)
        assert not errors
        assert len(ids_seen) == 1, "the resumed stream keeps the engine's id"
        log = router.log_path.read_text(errors="replace")[since:]
        assert "gpu engine failed after" in log and "resuming on the cpu engine" in log, log
        # The answer is one text: what the GPU sent, then the CPU's continuation of exactly
        # that text (tokenized again by the CPU engine), nothing repeated or lost.
        after = log.split("gpu engine failed after ")[1]
        tokens_so_far = int(after.split()[0])
        chars = int(after.split("(")[1].split()[0])
        assert 0 < tokens_so_far < TOTAL and 40 <= chars < len(text)
        prompt_ids = httpx.post(
            engines.cpu.url + "/tokenize",
            json={"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True},
            timeout=30,
        ).json()["tokens"]
        so_far_ids = httpx.post(
            engines.cpu.url + "/tokenize",
            json={"model": "tiny", "prompt": text[:chars], "add_special_tokens": False},
            timeout=30,
        ).json()["tokens"]
        assert len(so_far_ids) == tokens_so_far
        tail = ask(
            engines.cpu.url,
            {
                "model": "tiny",
                "prompt": prompt_ids + so_far_ids,
                "max_tokens": TOTAL - tokens_so_far,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert text[chars:] == tail["text"]
        assert usage is not None and usage["completion_tokens"] == TOTAL
        # What the GPU sent before it died is the start of the CPU's own answer.
        reference = ask(engines.cpu.url, _body(chat=True, stream=False, max_tokens=TOTAL))
        assert text[:chars] == reference["text"][:chars]
        assert metric(router, "syshax_router_fallbacks_total", kind="gpu-stream-to-cpu") >= 1
    finally:
        # Whatever failed above, the next test finds both engines up and the PD policy.
        policy.write_text(json.dumps(FORCED_PD))
        if not engines.gpu.alive():
            engines.gpu.restart()
        wait_for(lambda: metric(router, "syshax_router_backend_up", role="gpu") == 1, timeout=30)


def test_cpu_engine_killed_mid_stream_resumes_on_the_gpu(engines: Pair, router: Proc) -> None:
    body = _body(chat=False, stream=True, max_tokens=TOTAL)

    def stream() -> tuple[str, list[int], dict | None, list[dict]]:
        text, ids, usage, errors = "", [], None, []
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=300) as r:
            assert r.headers["x-syshax-route"] == "pd"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text += choice["text"]
                    ids += choice.get("token_ids") or []
                    if len(ids) >= 30 and engines.cpu.alive():
                        engines.cpu.kill()
        return text, ids, usage, errors

    (text, ids, usage, errors), since = _killed_mid_answer(engines.cpu, router, stream)
    assert not errors
    resumed_at = _moved_after(router, since)
    assert 0 < resumed_at < TOTAL
    assert usage is not None and usage["completion_tokens"] == len(ids) == TOTAL
    # Usage is tokens, not chunks (issue 38), and the prompt once: the GPU's re-prefill of
    # prompt plus text so far is the router's cost, not the client's.
    prompt_ids = httpx.post(
        engines.gpu.url + "/tokenize", json={"model": "tiny", "prompt": PROMPT}, timeout=30
    ).json()["tokens"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["total_tokens"] == len(prompt_ids) + TOTAL
    assert_spliced(engines.gpu.url, text, ids, resumed_at, TOTAL)
    assert metric(router, "syshax_router_fallbacks_total", kind="cpu-decode-to-gpu") >= 1
    # With the CPU engine gone, the next PD request is served by the GPU alone.
    after = ask(router.url, _body(chat=False, stream=False, max_tokens=8))
    assert after["route"] == "gpu-only" and len(after["ids"]) == 8
