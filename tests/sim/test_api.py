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

from syshax.sim.perfmodel import decode_step_time, effective_hardware, prefill_time
from syshax.sim.presets import DEVICES, MODELS

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
    # 2 + 3 words, 3 tokens per message, 3 for the reply header.
    assert out.usage.prompt_tokens == 5 + 2 * 3 + 3
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
    token_events = [
        e for e in events[1:] if e["choices"] and e["choices"][0]["delta"].get("content")
    ]
    assert len(token_events) == 4  # one chunk per token
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_raw_sse_completion_without_usage_has_no_usage_chunk(gpu_sim: SimProcess) -> None:
    raw = post_sse(
        gpu_sim.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    )
    events = raw.json_events()
    assert raw.events[-1] == "[DONE]"
    assert all(e["choices"] for e in events)
    assert [e["choices"][0]["text"] != "" for e in events] == [True, True, True, False]


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
    assert isinstance(httpx.get(f"{gpu_sim.url}/version").json()["version"], str)
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
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"max_tokens": 5}, "prompt"),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ],
)
def test_malformed_completion_requests_are_400(
    gpu_sim: SimProcess, body: bytes | dict[str, object], param: str | None
) -> None:
    status, err = _error(gpu_sim, "/v1/completions", body)
    assert status == 400 and err["type"] == "BadRequestError"
    assert err["param"] == param


def test_chat_without_messages_is_400(gpu_sim: SimProcess) -> None:
    status, err = _error(gpu_sim, "/v1/chat/completions", {"model": MODEL})
    assert status == 400 and err["param"] == "messages"
    status, err = _error(gpu_sim, "/v1/chat/completions", {"messages": [{"content": "no role"}]})
    assert status == 400


def test_over_max_model_len_is_400_with_the_numbers(gpu_sim: SimProcess) -> None:
    prompt = " ".join(["x"] * 4000)
    status, err = _error(gpu_sim, "/v1/completions", {"prompt": prompt, "max_tokens": 200})
    assert status == 400
    message = str(err["message"])
    for number in ("4096", "4200", "4000", "200"):
        assert number in message


def test_unknown_model_is_404(gpu_sim: SimProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(gpu_sim).completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in str(info.value)
    status, err = _error(gpu_sim, "/v1/completions", {"model": "other", "prompt": "hi"})
    assert status == 404 and err["type"] == "NotFoundError"


def test_natural_stop_without_max_tokens_is_seeded(gpu_sim: SimProcess) -> None:
    c = client(gpu_sim)
    a = c.completions.create(model=MODEL, prompt="tell me a story")
    b = c.completions.create(model=MODEL, prompt="tell me a story")
    assert a.choices[0].finish_reason == "stop"
    assert a.choices[0].text == b.choices[0].text
    assert a.usage is not None and a.usage.completion_tokens == len(a.choices[0].text.split())


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
    out = client(cpu_sim).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
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
