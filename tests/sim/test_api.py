"""The OpenAI-compatible API, driven through the official openai client and a raw SSE reader."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from sim_procs import MODEL, SimProcess
from sim_sse import post_sse

from common.presets import DEVICES, MODELS
from sim.perfmodel import decode_step_time, effective_hardware, prefill_time

PROMPT = " ".join(f"w{i}" for i in range(40))


def client(sim: SimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(params=["gpu", "cpu"])
def engine(request: pytest.FixtureRequest) -> SimProcess:
    sim: SimProcess = request.getfixturevalue(f"{request.param}_sim")
    return sim


def test_openai_completion_non_streaming(engine: SimProcess) -> None:
    out = client(engine).completions.create(model=MODEL, prompt=PROMPT, max_tokens=7)
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].text.split()) == 7
    assert out.choices[0].text.startswith(" ")
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (40, 7)
    assert out.usage.total_tokens == 47
    assert out.id.startswith("cmpl-")


def test_openai_chat_non_streaming(engine: SimProcess) -> None:
    out = client(engine).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "two words here"},
        ],
        max_tokens=5,
    )
    message = out.choices[0].message
    assert message.role == "assistant"
    assert message.content is not None and len(message.content.split()) == 5
    assert out.usage is not None
    # 2 + 3 words, 4 tokens per message, 3 for the reply header.
    assert out.usage.prompt_tokens == 5 + 2 * 4 + 3
    assert out.usage.completion_tokens == 5


def test_openai_chat_streaming_with_usage(engine: SimProcess) -> None:
    stream = client(engine).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [
        c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content
    ]
    assert len(contents) == 6
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_openai_completion_streaming_joins_to_non_streaming_text(gpu_sim: SimProcess) -> None:
    c = client(gpu_sim)
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9).choices[0].text
    pieces = [
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, stream=True)
        if ch.choices
    ]
    # Same seed and prompt -> same tokens; k tokens re-tokenise to exactly k words.
    assert "".join(pieces) == whole
    assert len(whole.split()) == 9


def test_raw_sse_stream_shape(engine: SimProcess) -> None:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = post_sse(engine.port, "/v1/chat/completions", payload)
    assert raw.status == 200
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.events[-1] == "[DONE]"
    events = raw.json_events()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["prompt_token_ids"] is None  # no return_token_ids
    token_events = [e for e in events[1:] if e["choices"]]
    assert len(token_events) == 4  # one chunk per token; the last one carries the finish
    assert all(e["choices"][0]["delta"]["content"] for e in token_events)
    assert [e["choices"][0]["finish_reason"] for e in token_events] == [None] * 3 + ["length"]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4
    assert usage["system_fingerprint"].startswith("vllm-0.32.0-")
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_raw_sse_completion_without_usage_has_no_usage_chunk(gpu_sim: SimProcess) -> None:
    raw = post_sse(
        gpu_sim.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    )
    events = raw.json_events()
    assert raw.events[-1] == "[DONE]"
    assert len(events) == 3 and all(e["choices"][0]["text"] for e in events)
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    # Without a usage chunk the last token's chunk is the stream's final message.
    assert ["system_fingerprint" in e for e in events] == [False, False, True]
    assert all(e["choices"][0]["token_ids"] is None for e in events)


def test_streamed_tokens_arrive_at_modelled_decode_pace(cpu_sim: SimProcess) -> None:
    # CPU decode steps are ~58 ms simulated (2.9 ms at --speed 20), so 30 tokens take
    # ~87 ms of wall time, not an instant burst.
    raw = post_sse(
        cpu_sim.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "stream": True}
    )
    gaps = [b - a for a, b in zip(raw.arrival[1:-2], raw.arrival[2:-1], strict=False)]
    span = raw.arrival[-2] - raw.arrival[0]
    assert span > 0.05
    assert sum(gaps) / len(gaps) > 0.0015


def test_health_version_models(gpu_sim: SimProcess) -> None:
    health = httpx.get(f"{gpu_sim.url}/health")
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(f"{gpu_sim.url}/version").json() == {"version": "0.32.0"}
    models = client(gpu_sim).models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{gpu_sim.url}/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 4096
    assert raw["data"][0]["owned_by"] == "vllm"


def _error(
    sim: SimProcess, path: str, body: bytes | dict[str, object]
) -> tuple[int, dict[str, object]]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{sim.url}{path}", content=content, headers={"content-type": "application/json"}
    )
    payload = r.json()
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == r.status_code
    return r.status_code, payload["error"]


@pytest.mark.parametrize(
    ("body", "param", "err_type"),
    [
        (b"{not json", "body.1", "Bad Request"),
        (b"[1, 2]", "body", "Bad Request"),
        ({"max_tokens": 5}, "prompt", "BadRequestError"),
        ({"prompt": "", "max_tokens": 5}, "prompt", "BadRequestError"),
        ({"prompt": "hi", "max_tokens": "five"}, "body.max_tokens", "Bad Request"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "BadRequestError"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "BadRequestError"),
        ({"prompt": "hi", "stream": "maybe"}, "body.stream", "Bad Request"),
        ({"prompt": 42}, "body.prompt", "Bad Request"),
        ({"prompt": [1, -1]}, "body.prompt.1", "Bad Request"),
        ({"prompt": [10**7]}, None, "BadRequestError"),
        ({"prompt": "hi", "temperature": "hot"}, "body.temperature", "Bad Request"),
        ({"prompt": "hi", "kv_transfer_params": "x"}, "body.kv_transfer_params", "Bad Request"),
    ],
)
def test_malformed_completion_requests_are_400_in_vllms_shapes(
    gpu_sim: SimProcess, body: bytes | dict[str, object], param: str | None, err_type: str
) -> None:
    # vLLM 0.32 has two: a pydantic validation error ("Bad Request", param "body.<field>")
    # and a request check ("BadRequestError", param "<field>").
    status, err = _error(gpu_sim, "/v1/completions", body)
    assert status == 400
    assert (err["param"], err["type"]) == (param, err_type)


def test_fields_are_coerced_as_vllms_pydantic_models_coerce_them(gpu_sim: SimProcess) -> None:
    r = httpx.post(
        f"{gpu_sim.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": "5", "stream": "no", "temperature": "0.5"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5


def test_unknown_and_syshax_fields_are_ignored_without_syshax_compat(gpu_sim: SimProcess) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = httpx.post(
            f"{gpu_sim.url}{path}",
            json={**body, "max_tokens": 2, "num_decode_tokens": 0, "bogus": 1,
                  "generated_text": "x y", "request_id_inference": "../../etc"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] == 2
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["id"] != "../../etc"


def test_chat_without_messages_is_400(gpu_sim: SimProcess) -> None:
    status, err = _error(gpu_sim, "/v1/chat/completions", {"model": MODEL})
    assert status == 400 and err["param"] == "body.messages"
    status, err = _error(gpu_sim, "/v1/chat/completions", {"messages": [{"content": "no role"}]})
    assert status == 400


def test_max_tokens_past_max_model_len_is_clamped_like_vllm(gpu_sim: SimProcess) -> None:
    prompt = " ".join(["x"] * 4000)
    r = httpx.post(f"{gpu_sim.url}/v1/completions", json={"prompt": prompt, "max_tokens": 200})
    assert r.status_code == 200
    body = r.json()
    assert body["usage"]["completion_tokens"] == 96  # what fits in 4096
    assert body["choices"][0]["finish_reason"] == "length"


def test_max_tokens_above_max_model_len_is_400(gpu_sim: SimProcess) -> None:
    status, err = _error(gpu_sim, "/v1/completions", {"prompt": "hi", "max_tokens": 10**7})
    assert status == 400 and (err["param"], err["type"]) == ("max_tokens", "BadRequestError")
    assert "cannot be greater than max_model_len=4096" in str(err["message"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
    status, err = _error(gpu_sim, "/v1/chat/completions", chat)
    assert status == 400 and err["param"] == "max_completion_tokens"


def test_a_prompt_over_max_model_len_is_400_with_the_numbers(gpu_sim: SimProcess) -> None:
    status, err = _error(gpu_sim, "/v1/completions", {"prompt": " ".join(["x"] * 4100)})
    assert status == 400 and err["param"] == "input_tokens"
    assert "4096" in str(err["message"]) and "4100" in str(err["message"])
    # A prompt of exactly max_model_len leaves no room for one output token.
    status, err = _error(gpu_sim, "/v1/completions", {"prompt": " ".join(["x"] * 4096)})
    assert status == 400 and err["param"] == "max_tokens"


def test_unknown_model_is_404(gpu_sim: SimProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(gpu_sim).completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in str(info.value)
    status, err = _error(gpu_sim, "/v1/completions", {"model": "other", "prompt": "hi"})
    assert status == 404 and err["type"] == "NotFoundError" and err["param"] == "model"


def test_completions_default_to_16_tokens_like_vllm(gpu_sim: SimProcess) -> None:
    out = client(gpu_sim).completions.create(model=MODEL, prompt="tell me a story")
    assert out.usage is not None and out.usage.completion_tokens == 16
    assert out.choices[0].finish_reason == "length"


def test_without_max_tokens_a_sequence_stops_by_itself_the_same_way_every_time(
    gpu_sim: SimProcess,
) -> None:
    c = client(gpu_sim)
    messages = [{"role": "user", "content": "tell me a story"}]
    a = c.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    b = c.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    assert a.choices[0].finish_reason == "stop"
    assert a.choices[0].message.content == b.choices[0].message.content
    text = a.choices[0].message.content or ""
    assert a.usage is not None and a.usage.completion_tokens == len(text.split())
    explicit_null = httpx.post(
        f"{gpu_sim.url}/v1/completions", json={"prompt": "tell me a story", "max_tokens": None}
    ).json()
    assert explicit_null["choices"][0]["finish_reason"] == "stop"


def test_sim_requests_ring_reports_own_timings(gpu_sim: SimProcess) -> None:
    since = time.time()
    out = client(gpu_sim).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    ring = httpx.get(f"{gpu_sim.url}/sim/requests", params={"since": since}).json()
    mine = [r for r in ring["requests"] if r["request_id"] == out.id]
    assert len(mine) == 1
    rec = mine[0]
    assert rec["completion_tokens"] == 5 and rec["prompt_tokens"] == 40
    assert len(rec["token_times"]) == 5 == len(rec["emitted_times"])
    assert rec["received_at"] <= rec["first_token_at"] <= rec["finished_at"]
    assert rec["token_times"] == sorted(rec["token_times"])
    assert rec["first_token_at"] == rec["token_times"][0]
    assert since <= rec["received_at"] <= time.time()
    assert ring["speed"] == 20.0


def test_a_client_that_hangs_up_frees_its_sequence(cpu_sim: SimProcess) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    def running() -> float:
        for line in httpx.get(f"{cpu_sim.url}/metrics").text.splitlines():
            if line.startswith("vllm:num_requests_running{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no running gauge")

    with socket.create_connection(("127.0.0.1", cpu_sim.port)) as sock:
        sock.sendall(head + body)
        assert b'"text":" ' in sock.recv(65536) + sock.recv(65536)
        assert running() == 1
    deadline = time.monotonic() + 5
    while running() != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running() == 0


def test_live_token_schedule_is_the_performance_model(cpu_sim: SimProcess) -> None:
    # The engine's modelled token times (wall, at --speed 20) must be the roofline's step
    # times for a lone sequence: prefill of 40 tokens, then one decode step per token.
    # (Epoch floats carry ~0.2 us, so the comparison is to 0.1%.)
    hw = effective_hardware(DEVICES["kunpeng-920-7280z"])
    model = MODELS[MODEL]
    # A prompt no other test sent, so the prefix cache holds none of it.
    prompt = " ".join(f"schedule{i}" for i in range(40))
    out = client(cpu_sim).completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    rec = next(
        r
        for r in httpx.get(f"{cpu_sim.url}/sim/requests").json()["requests"]
        if r["request_id"] == out.id
    )
    times = [t * 20 for t in rec["token_times"]]
    assert (times[0] - rec["received_at"] * 20) == pytest.approx(
        prefill_time(hw, model, 40), rel=0.05
    )
    for k in range(1, 8):
        # Step k decodes token k, reading the KV of the 40 + k - 1 tokens before it.
        expected = decode_step_time(hw, model, 1, 40 + k - 1)
        assert times[k] - times[k - 1] == pytest.approx(expected, rel=1e-3)
