"""vLLM 0.32's /tokenize and /detokenize on the simulator: the same tokenizer and chat
template as its completions, so the ids they give are the ids a request runs on."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sim_procs import MODEL, SimProcess

from common.presets import MODELS
from sim.tokens import VOCABULARY_SIZE, Tokenizer

PROMPT = "the prefill decode token cache engine router policy node card"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]


def call(sim: SimProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{sim.url}{path}", json=body, timeout=30)


def ok(sim: SimProcess, path: str, body: dict[str, Any]) -> Any:
    response = call(sim, path, {"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def text_of(ids: list[int]) -> str:
    return Tokenizer(MODELS[MODEL].vocab_size).decode(ids)


def generate(sim: SimProcess, path: str, body: dict[str, Any]) -> Any:
    return ok(sim, path, {"max_tokens": 6, "ignore_eos": True, "return_token_ids": True, **body})


def test_tokenize_a_prompt_gives_the_ids_a_completion_runs_on(gpu_sim: SimProcess) -> None:
    answer = ok(gpu_sim, "/tokenize", {"prompt": PROMPT})
    assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    completion = generate(gpu_sim, "/v1/completions", {"prompt": PROMPT})
    assert answer["tokens"] == completion["choices"][0]["prompt_token_ids"]
    assert answer["count"] == len(answer["tokens"]) == completion["usage"]["prompt_tokens"]
    assert answer["max_model_len"] == 4096 and answer["token_strs"] is None
    # No BOS token in this tokenizer: add_special_tokens changes nothing.
    plain = ok(gpu_sim, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert plain["tokens"] == answer["tokens"]


def test_tokenize_messages_gives_a_chat_completions_prompt_ids(gpu_sim: SimProcess) -> None:
    chat = generate(gpu_sim, "/v1/chat/completions", {"messages": CHAT})
    answer = ok(gpu_sim, "/tokenize", {"messages": CHAT, "add_generation_prompt": True})
    assert answer["tokens"] == chat["prompt_token_ids"]
    assert answer["count"] == chat["usage"]["prompt_tokens"]
    assert ok(gpu_sim, "/tokenize", {"messages": CHAT})["tokens"] == answer["tokens"]
    # Without the reply header (<start> assistant <newline>), and with the last message open.
    bare = ok(gpu_sim, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert bare["tokens"] == answer["tokens"][:-3]
    open_last = ok(
        gpu_sim,
        "/tokenize",
        {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert open_last["tokens"] == bare["tokens"][:-1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generated_text_and_its_ids_convert_both_ways(gpu_sim: SimProcess, path: str) -> None:
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
    answer = generate(gpu_sim, path, prompt)
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    ids = choice["token_ids"]
    again = ok(gpu_sim, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert again["tokens"] == ids
    assert ok(gpu_sim, "/detokenize", {"tokens": ids}) == {"prompt": text}


def test_any_ids_detokenize_to_text_that_tokenizes_back(gpu_sim: SimProcess) -> None:
    """Prompt words and chat markers have no word to give back; their placeholder does."""
    chat_ids = ok(gpu_sim, "/tokenize", {"messages": CHAT})["tokens"]
    text = ok(gpu_sim, "/detokenize", {"tokens": chat_ids})["prompt"]
    assert ok(gpu_sim, "/tokenize", {"prompt": text})["tokens"] == chat_ids
    strs = ok(gpu_sim, "/tokenize", {"messages": CHAT, "return_token_strs": True})["token_strs"]
    assert len(strs) == len(chat_ids) and "".join(strs) == text
    assert ok(gpu_sim, "/detokenize", {"tokens": []}) == {"prompt": ""}
    # An id past the vocabulary decodes to nothing, as vLLM's tokenizer decodes it.
    assert ok(gpu_sim, "/detokenize", {"tokens": [3, 10**9]}) == {"prompt": text_of([3])}


def test_the_tokenizer_round_trips_every_id() -> None:
    tok = Tokenizer(MODELS[MODEL].vocab_size)
    ids = [0, 7, VOCABULARY_SIZE - 1, VOCABULARY_SIZE, 99_999, tok.vocab_size - 1]
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.decode([3]) == tok.token_text(3) and tok.decode([5000]) == " <|5000|>"
    assert tok.decode([tok.vocab_size, 10**9]) == ""
    # A placeholder past the vocabulary is an ordinary (hashed) word.
    assert tok.encode(f"<|{tok.vocab_size}|>") != [tok.vocab_size]


# As vLLM 0.32 answers them (tests/realengine/test_contract.py compares most with it): a body
# that is neither /tokenize form gets the errors of both, the prompt form's first.
ERRORS = [
    ("/tokenize", {"model": MODEL}, 400, "Bad Request", "body.prompt"),
    ("/tokenize", {"prompt": 5}, 400, "Bad Request", "body.prompt"),
    ("/tokenize", {"messages": "hi"}, 400, "Bad Request", "body.prompt"),
    ("/tokenize", {"messages": [{"content": "x"}]}, 400, "Bad Request", "body.prompt"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": "maybe"}, 400, "Bad Request",
     "body.prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "maybe"}, 400, "Bad Request",
     "body.add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": True,
                   "continue_final_message": True}, 400, "BadRequestError", None),
    ("/tokenize", {"messages": []}, 400, "BadRequestError", None),
    ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "NotFoundError", "model"),
    ("/detokenize", {"model": MODEL}, 400, "Bad Request", "body.tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "Bad Request", "body.tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "Bad Request", "body.tokens.1"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "Bad Request", "body.tokens.1"),
    ("/detokenize", {"tokens": [2**64]}, 400, "Bad Request", "body.tokens.0"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "NotFoundError", "model"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "kind", "param"), ERRORS)
def test_bad_input_gets_vllms_error_shapes(
    gpu_sim: SimProcess, path: str, body: dict[str, Any], status: int, kind: str, param: str
) -> None:
    response = call(gpu_sim, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (kind, param, status)


def test_malformed_json_is_a_validation_error(gpu_sim: SimProcess) -> None:
    for path in ("/tokenize", "/detokenize"):
        response = httpx.post(
            f"{gpu_sim.url}{path}", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "Bad Request"
