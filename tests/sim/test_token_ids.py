"""Token ids: return_token_ids answers in vLLM 0.32's shapes, and generation as a function of
the token context (a continuation from token ids equals the uninterrupted request)."""

from __future__ import annotations

from typing import Any

import httpx
from sim_procs import MODEL, SimProcess
from sim_sse import post_sse

from common.presets import MODELS
from sim.tokens import VOCABULARY_SIZE, Tokenizer, TokenModel, decode

PROMPT = "the prefill decode token cache engine router policy node card"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
COMPLETION_CHOICE = {
    "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
    "prompt_logprobs", "prompt_token_ids", "routed_experts",
}  # fmt: skip
TOP = {
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
    "usage", "kv_transfer_params", "ec_transfer_params", "metrics",
}  # fmt: skip


def post(sim: SimProcess, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    r = httpx.post(f"{sim.url}{path}", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenizer_is_stable_and_generated_text_tokenises_back() -> None:
    tok = Tokenizer(MODELS[MODEL].vocab_size)
    ids = tok.encode("hello world hello")
    assert ids[0] == ids[2] != ids[1]
    assert all(VOCABULARY_SIZE <= i < tok.vocab_size for i in ids)
    generated = [7, 4095, 0, 123]
    assert tok.encode(decode(generated)) == generated
    model = TokenModel(7)
    assert model.sample([1, 2, 3], 10) == TokenModel(7).sample([1, 2, 3], 10)
    assert model.sample([1, 2, 3], 10) != model.sample([1, 2, 3], 11)


def test_completion_with_return_token_ids(gpu_sim: SimProcess) -> None:
    body = post(gpu_sim, {"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True})
    assert set(body) == TOP
    choice = body["choices"][0]
    assert set(choice) == COMPLETION_CHOICE
    assert len(choice["token_ids"]) == 5 == body["usage"]["completion_tokens"]
    assert decode(choice["token_ids"]) == choice["text"]
    tok = Tokenizer(MODELS[MODEL].vocab_size)
    assert choice["prompt_token_ids"] == tok.encode(PROMPT)
    plain = post(gpu_sim, {"prompt": PROMPT, "max_tokens": 5})["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    assert plain["text"] == choice["text"]


def test_chat_with_return_token_ids_puts_the_prompt_at_the_top(gpu_sim: SimProcess) -> None:
    body = post(
        gpu_sim,
        {"messages": CHAT, "max_tokens": 3, "return_token_ids": True},
        "/v1/chat/completions",
    )
    assert {"prompt_token_ids", "prompt_text", "prompt_logprobs"} <= set(body)
    choice = body["choices"][0]
    assert "prompt_token_ids" not in choice and len(choice["token_ids"]) == 3
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"] == 2 + 10 + 2 * 4 + 3
    assert set(choice["message"]) == {
        "role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"
    }  # fmt: skip


def test_streamed_token_ids(gpu_sim: SimProcess) -> None:
    whole = post(gpu_sim, {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True})
    raw = post_sse(
        gpu_sim.port,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 4, "stream": True, "return_token_ids": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    events = raw.json_events()
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert [c["token_ids"] for c in choices] == [[t] for t in whole["choices"][0]["token_ids"]]
    assert choices[0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert set(events[-1]) == {"id", "object", "created", "model", "choices", "usage",
                               "system_fingerprint"}  # fmt: skip

    chat = post_sse(
        gpu_sim.port,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 2, "stream": True, "return_token_ids": True},
    ).json_events()
    assert isinstance(chat[0]["prompt_token_ids"], list) and chat[0]["prompt_text"] is None
    assert [len(e["choices"][0]["token_ids"]) for e in chat[1:]] == [1, 1]
    assert chat[-1]["choices"][0]["stop_reason"] is None and "system_fingerprint" in chat[-1]


def test_a_continuation_from_token_ids_equals_the_uninterrupted_request(
    gpu_sim: SimProcess, cpu_sim: SimProcess
) -> None:
    whole = post(gpu_sim, {"prompt": PROMPT, "max_tokens": 12, "return_token_ids": True})
    expected = whole["choices"][0]["token_ids"]
    prompt_ids = whole["choices"][0]["prompt_token_ids"]
    # Stop after 5 tokens, continue on the other engine from prompt + generated ids.
    head = post(gpu_sim, {"prompt": prompt_ids, "max_tokens": 5, "return_token_ids": True})
    generated = head["choices"][0]["token_ids"]
    rest = post(
        cpu_sim, {"prompt": prompt_ids + generated, "max_tokens": 7, "return_token_ids": True}
    )
    assert generated + rest["choices"][0]["token_ids"] == expected

    chat = post(
        gpu_sim,
        {"messages": CHAT, "max_tokens": 6, "return_token_ids": True},
        "/v1/chat/completions",
    )
    first = chat["choices"][0]["token_ids"][:1]
    continued = post(
        cpu_sim, {"prompt": chat["prompt_token_ids"] + first, "max_tokens": 5,
                  "return_token_ids": True},
    )  # fmt: skip
    assert first + continued["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
