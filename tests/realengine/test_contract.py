"""The simulator against real vLLM 0.32: the same requests to both, and the answers compared
by shape (key sets, value types, status codes, error types and params), never by text.

One real engine (the tiny random-weight model on one CPU, with the SyshaxShmConnector naming
itself as its own peer, so one engine can both publish and load a transfer) and one
simulator configured the same way. What is compared is listed in docs/simulator.md
("Contract with real vLLM"). vLLM must be installable: if it is not, the fixture fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.supervisor import ReadyChild, free_port, python_argv
from testbed import vllm_env

pytestmark = pytest.mark.timeout(1200)
ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
MAX_MODEL_LEN = 2048
PROMPT = "the prefill decode token cache engine router policy node card memory shared"
MESSAGES = [{"role": "user", "content": PROMPT}]
# The families 1b of the PD contract names: they show the transferred KV was used.
PD_FAMILIES = {
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_cached",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
}
# What the simulator adds by default (--metrics both) for routers of older engines; vLLM 0.32
# has none of them.
SIM_LEGACY = {
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:num_requests_swapped",
    "vllm:avg_prompt_throughput_toks_per_s",
    "vllm:avg_generation_throughput_toks_per_s",
    "vllm:time_per_output_token_seconds",
}


class Sim(ReadyChild):
    pass


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("contract")


@pytest.fixture(scope="module")
def real(workdir: Path) -> Iterator[vllm_env.VllmEngine]:
    shm = workdir / "real-shm"
    shm.mkdir()
    engine = vllm_env.VllmEngine(
        "real",
        free_port(),
        workdir,
        cpus="1",
        kv_transfer_config=vllm_env.connector_config("real", "real", shm),
        max_model_len=MAX_MODEL_LEN,
    )
    try:
        engine.wait_ready()
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    shm = workdir / "sim-shm"
    shm.mkdir()
    argv = python_argv(
        "sim", "--device", "a100-80gb", "--model", "qwen2.5-7b-instruct",
        "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--speed", "20",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", vllm_env.connector_config("sim", "sim", shm),
    )  # fmt: skip
    child = Sim("sim", argv, workdir, cwd=ROOT, timeout=30)
    yield child
    child.stop()


Engine = vllm_env.VllmEngine | Sim


def shape(value: Any) -> Any:
    """Keys and value types, recursively (lists by their first element)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def post(engine: Engine, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            engine.url + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=120,
        )
    return httpx.post(engine.url + path, json=body, timeout=120)


def stream(engine: Engine, path: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    with httpx.stream("POST", engine.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def both(real: vllm_env.VllmEngine, sim: Sim, path: str, body: dict[str, Any] | bytes) -> list[Any]:
    return [post(engine, path, body) for engine in (real, sim)]


# -- metrics ---------------------------------------------------------------------------------


def families(engine: Engine) -> dict[str, tuple[str, frozenset[str]]]:
    """vllm:* family -> (type, label names)."""
    text = httpx.get(engine.url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
            out[family.name] = (family.type, labels)
    return out


def names_read_by_the_router_and_the_load_generator() -> set[str]:
    """Every vllm:* sample name in router/engines/load.py and loadgen/, as a family."""
    sources = [ROOT / "router" / "engines" / "load.py", *(ROOT / "loadgen").glob("*.py")]
    names = set()
    for source in sources:
        names |= set(re.findall(r"vllm:[a-z_]+", source.read_text()))
    return {re.sub(r"(_total|_sum|_count|_bucket)$", "", n) for n in names}


def test_metric_families_match(real: vllm_env.VllmEngine, sim: Sim) -> None:
    read = names_read_by_the_router_and_the_load_generator()
    assert "vllm:num_requests_running" in read
    theirs, ours = families(real), families(sim)
    for name in sorted((read & set(theirs)) | PD_FAMILIES):
        assert name in theirs, f"vLLM 0.32 has no {name}"
        assert ours.get(name) == theirs[name], f"{name}: vLLM {theirs[name]}, sim {ours.get(name)}"
    # What the router reads that vLLM lacks is the simulator's legacy set, nothing else.
    assert read - set(theirs) <= SIM_LEGACY
    assert not SIM_LEGACY & set(theirs)


def metric(engine: Engine, name: str) -> float:
    total = 0.0
    for line in httpx.get(engine.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- errors ----------------------------------------------------------------------------------

ERROR_CASES = [
    ("malformed json", "/v1/completions", b"{not json"),
    ("missing prompt", "/v1/completions", {"model": MODEL, "max_tokens": 2}),
    ("missing messages", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2}),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}),
    ("unknown model, chat", "/v1/chat/completions",
     {"model": "nope", "messages": MESSAGES, "max_tokens": 2}),
    ("prompt over max_model_len", "/v1/completions", {"model": MODEL, "prompt": [5] * 2100}),
    ("max_tokens over max_model_len", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 10**7}),
    ("max_tokens negative", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}),
    ("max_tokens zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}),
    ("max_tokens negative, chat", "/v1/chat/completions",
     {"model": MODEL, "messages": MESSAGES, "max_tokens": -1}),
    ("tokenize, neither prompt nor messages", "/tokenize", {"model": MODEL}),
    ("tokenize, prompt not a string", "/tokenize", {"model": MODEL, "prompt": 5}),
    ("tokenize, messages not a list", "/tokenize", {"model": MODEL, "messages": "hi"}),
    ("tokenize, a message without a role", "/tokenize",
     {"model": MODEL, "messages": [{"content": "hi"}]}),
    ("tokenize, a flag not a boolean", "/tokenize",
     {"model": MODEL, "prompt": "hi", "add_special_tokens": "maybe"}),
    ("tokenize, both generation prompt and an open last message", "/tokenize",
     {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True,
      "continue_final_message": True}),
    ("tokenize, no messages", "/tokenize", {"model": MODEL, "messages": []}),
    ("tokenize, unknown model", "/tokenize", {"model": "nope", "prompt": "hi"}),
    ("detokenize, no tokens", "/detokenize", {"model": MODEL}),
    ("detokenize, negative id", "/detokenize", {"model": MODEL, "tokens": [1, -1]}),
    ("detokenize, id not an integer", "/detokenize", {"model": MODEL, "tokens": [1, "a"]}),
    ("detokenize, id past int64", "/detokenize", {"model": MODEL, "tokens": [2**64]}),
    ("detokenize, unknown model", "/detokenize", {"model": "nope", "tokens": [1]}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "body"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_have_vllms_status_and_shape(
    real: vllm_env.VllmEngine, sim: Sim, case: str, path: str, body: dict[str, Any] | bytes
) -> None:
    theirs, ours = both(real, sim, path, body)
    assert ours.status_code == theirs.status_code >= 400
    t, o = theirs.json()["error"], ours.json()["error"]
    assert shape(o) == shape(t)
    assert (o["type"], o["param"], o["code"]) == (t["type"], t["param"], t["code"])


@pytest.mark.parametrize(
    ("case", "body"),
    [
        ("no model", {"prompt": "hi", "max_tokens": 2}),
        ("prompt + max_tokens over max_model_len", {"prompt": [5] * 2000, "max_tokens": 100}),
    ],
)
def test_requests_vllm_answers_with_200(
    real: vllm_env.VllmEngine, sim: Sim, case: str, body: dict[str, Any]
) -> None:
    theirs, ours = both(real, sim, "/v1/completions", {**body, "ignore_eos": True})
    assert (ours.status_code, theirs.status_code) == (200, 200), ours.text + theirs.text
    t, o = theirs.json(), ours.json()
    assert o["usage"]["completion_tokens"] == t["usage"]["completion_tokens"]
    assert o["choices"][0]["finish_reason"] == t["choices"][0]["finish_reason"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_syshax_and_unknown_fields_are_ignored(
    real: vllm_env.VllmEngine, sim: Sim, path: str
) -> None:
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    body = {
        "model": MODEL, **prompt, "max_tokens": 2, "ignore_eos": True, "num_decode_tokens": 0,
        "generated_text": "x y", "request_id_inference": "cmpl-abc", "bogus": 1,
    }  # fmt: skip
    theirs, ours = both(real, sim, path, body)
    assert (ours.status_code, theirs.status_code) == (200, 200)
    counts = [r.json()["usage"]["completion_tokens"] for r in (theirs, ours)]
    assert counts == [2, 2]


# -- flags -----------------------------------------------------------------------------------


def test_flags_refused_and_accepted_alike(real: vllm_env.VllmEngine, sim: Sim) -> None:
    refused = {
        "vllm": [str(vllm_env.python()), "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(vllm_env.MODEL), "--preemption-mode", "swap"],
        "sim": python_argv("sim", "--device", "a100-80gb", "--model", "qwen2.5-7b-instruct",
                           "--preemption-mode", "swap"),
    }  # fmt: skip
    for name, argv in refused.items():
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 2, f"{name}: {done.stderr[-2000:]}"
        assert "unrecognized arguments" in done.stderr, name
    # Both fixtures run with --kv-transfer-config naming the SyshaxShmConnector.
    assert "SyshaxShmConnector real" in real.log_text()
    info = httpx.get(sim.url + "/sim/info").json()
    assert info["kv_connector"]["engine_id"] == "sim"


def test_version(real: vllm_env.VllmEngine, sim: Sim) -> None:
    theirs = httpx.get(real.url + "/version").json()
    ours = httpx.get(sim.url + "/version").json()
    assert ours == theirs == {"version": "0.32.0"}


def test_models_list_shape(real: vllm_env.VllmEngine, sim: Sim) -> None:
    theirs = httpx.get(real.url + "/v1/models").json()
    ours = httpx.get(sim.url + "/v1/models").json()
    assert shape(ours) == shape(theirs)


# -- /tokenize and /detokenize ---------------------------------------------------------------


TOKENIZE_BODIES = {
    "prompt": {"model": MODEL, "prompt": PROMPT},
    "prompt, no special tokens": {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False},
    "messages": {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True},
    "token strings": {"model": MODEL, "prompt": PROMPT, "return_token_strs": True},
}


@pytest.mark.parametrize("case", list(TOKENIZE_BODIES))
def test_tokenize_answer_shape(real: vllm_env.VllmEngine, sim: Sim, case: str) -> None:
    theirs, ours = both(real, sim, "/tokenize", TOKENIZE_BODIES[case])
    assert (ours.status_code, theirs.status_code) == (200, 200), ours.text + theirs.text
    assert (
        set(ours.json()) == set(theirs.json()) == {"count", "max_model_len", "tokens", "token_strs"}
    )
    assert shape(ours.json()) == shape(theirs.json())
    for answer in (theirs.json(), ours.json()):
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == MAX_MODEL_LEN


def test_tokenized_messages_are_the_chat_prompt_ids(real: vllm_env.VllmEngine, sim: Sim) -> None:
    """On each engine, /tokenize of a chat request's messages gives exactly the prompt ids
    its chat completion runs on (what the router relies on to resume a stream)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "return_token_ids": True}
    for engine in (real, sim):
        chat = post(engine, "/v1/chat/completions", body).json()
        tokens = post(engine, "/tokenize", TOKENIZE_BODIES["messages"]).json()["tokens"]
        assert tokens == chat["prompt_token_ids"], engine.name


def test_detokenize_answer_shape(real: vllm_env.VllmEngine, sim: Sim) -> None:
    shapes = []
    for engine in (real, sim):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        answer = post(engine, "/v1/completions", body).json()
        ids = answer["choices"][0]["token_ids"]
        response = post(engine, "/detokenize", {"model": MODEL, "tokens": ids})
        assert response.status_code == 200, response.text
        assert set(response.json()) == {"prompt"}
        shapes.append(shape(response.json()))
        # An id past the vocabulary is no error: it decodes to nothing.
        past = post(engine, "/detokenize", {"model": MODEL, "tokens": [10**9]})
        assert (past.status_code, past.json()) == (200, {"prompt": ""}), engine.name
    assert shapes[0] == shapes[1]


# -- answers with token ids ------------------------------------------------------------------


@pytest.mark.parametrize("return_token_ids", [True, False])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_answer_shape(
    real: vllm_env.VllmEngine, sim: Sim, path: str, return_token_ids: bool
) -> None:
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    body = {"model": MODEL, **prompt, "max_tokens": 3, "ignore_eos": True,
            "return_token_ids": return_token_ids}  # fmt: skip
    theirs, ours = both(real, sim, path, body)
    assert shape(ours.json()) == shape(theirs.json())


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("return_token_ids", [True, False])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunk_shapes(
    real: vllm_env.VllmEngine, sim: Sim, path: str, return_token_ids: bool, include_usage: bool
) -> None:
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    body = {
        "model": MODEL, **prompt, "max_tokens": 3, "ignore_eos": True, "stream": True,
        "return_token_ids": return_token_ids,
        "stream_options": {"include_usage": include_usage},
    }  # fmt: skip
    theirs, ours = (stream(engine, path, body) for engine in (real, sim))
    assert ours[-1] == theirs[-1] == "[DONE]"
    # Chunk by chunk: (chat's role chunk), first, middle, last token, (usage).
    assert [shape(e) for e in ours] == [shape(e) for e in theirs]


# -- the PD contract -------------------------------------------------------------------------


def prefill(engine: Engine, path: str = "/v1/completions") -> Any:
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    body = {"model": MODEL, **prompt, "max_tokens": 1, "temperature": 0, "stream": False,
            "return_token_ids": True, "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    response = post(engine, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def decode_body(answer: Any, **change: Any) -> dict[str, Any]:
    choice = answer["choices"][0]
    prompt_ids = choice.get("prompt_token_ids") or answer["prompt_token_ids"]
    params = {k: v for k, v in answer["kv_transfer_params"].items()
              if k != "remote_prefill_cached_tokens"}  # fmt: skip
    return {
        "model": MODEL, "prompt": prompt_ids + choice["token_ids"], "max_tokens": 4,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "kv_transfer_params": {**params, **change},
    }  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_answer_shape(real: vllm_env.VllmEngine, sim: Sim, path: str) -> None:
    theirs, ours = prefill(real, path), prefill(sim, path)
    assert shape(ours) == shape(theirs)
    assert ours["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    # Use the transfers, so their segments do not wait for their leases.
    for engine, answer in ((real, theirs), (sim, ours)):
        stream(engine, "/v1/completions", decode_body(answer))


def test_decode_loads_the_transfer_and_says_so(real: vllm_env.VllmEngine, sim: Sim) -> None:
    for engine in (real, sim):
        answer = prefill(engine)
        num_tokens = answer["kv_transfer_params"]["num_tokens"]
        hits = metric(engine, "vllm:external_prefix_cache_hits_total")
        events = stream(engine, "/v1/completions", decode_body(answer))
        usage = events[-2]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= num_tokens, engine
        assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-2]) == 4
        deadline = time.monotonic() + 10  # vLLM's metrics follow its engine core's steps
        while metric(engine, "vllm:external_prefix_cache_hits_total") < hits + num_tokens:
            assert time.monotonic() < deadline, f"{engine}: external hits did not move"
            time.sleep(0.2)


@pytest.mark.parametrize(
    "change",
    [
        {"producer_engine_id": "someone-else"},
        {"ipc_namespace": "ipc:[1]"},
        {"geometry": {"layers": 1}},
        {"lease_expires_at": 1},
        {"transfer_id": "0" * 32},
    ],
    ids=["other producer", "other IPC namespace", "geometry", "lease expired", "missing"],
)
def test_an_unusable_transfer_is_recomputed_by_both(
    real: vllm_env.VllmEngine, sim: Sim, change: dict[str, Any]
) -> None:
    shapes = []
    for engine in (real, sim):
        answer = prefill(engine)
        body = {**decode_body(answer, **change), "stream": False}
        body.pop("stream_options")
        response = post(engine, "/v1/completions", body)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert set(data["kv_transfer_params"]) == {"syshax_kv_error"}
        shapes.append(shape(data))
        stream(engine, "/v1/completions", decode_body(answer))  # the segment's own decode
    assert shapes[0] == shapes[1]


# -- the prefix cache ------------------------------------------------------------------------


def cache_setting(engine: Engine, label: str) -> str:
    """A label of ``vllm:cache_config_info`` (the KV cache's settings)."""
    text = httpx.get(engine.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            return str(family.samples[0].labels[label])
    raise AssertionError(f"{engine}: no vllm:cache_config_info")


def token_ids(engine: Engine, prompt: str) -> list[int]:
    response = post(engine, "/tokenize", {"model": MODEL, "prompt": prompt})
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["tokens"]
    return ids


def wait_for_metric(engine: Engine, name: str, value: float) -> None:
    deadline = time.monotonic() + 10  # vLLM's metrics follow its engine core's steps
    while (seen := metric(engine, name)) != value:
        assert time.monotonic() < deadline, f"{engine}: {name} is {seen}, expected {value}"
        time.sleep(0.2)


def test_prefix_cache_hits_follow_the_same_rule(real: vllm_env.VllmEngine, sim: Sim) -> None:
    """The same prompts to both: a prompt hits the whole blocks it shares with one computed
    before, never its last token (vLLM computes that for its logits), and both count the
    queries and hits alike. Block sizes and tokenizers differ (vLLM's CPU backend uses 128-token
    blocks and a BOS token), so each engine's expectation is computed from its own."""
    words = [f"cachew{i}" for i in range(200)]
    first = again = " ".join(words)
    branch = " ".join(words[:100] + [f"other{i}" for i in range(100)])
    for engine in (real, sim):
        assert cache_setting(engine, "enable_prefix_caching") == "True", engine
        block = int(cache_setting(engine, "block_size"))
        ids_first, ids_branch = token_ids(engine, first), token_ids(engine, branch)
        assert len(ids_first) > 2 * block, f"{engine}: the prompt must span whole blocks"
        shared = next(
            (i for i, (a, b) in enumerate(zip(ids_first, ids_branch, strict=False)) if a != b),
            min(len(ids_first), len(ids_branch)),
        )
        queries = metric(engine, "vllm:prefix_cache_queries_total")
        hits = metric(engine, "vllm:prefix_cache_hits_total")
        expected = []
        for prompt, ids, common in (
            (first, ids_first, 0),
            (again, ids_first, len(ids_first)),
            (branch, ids_branch, shared),
        ):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            response = post(engine, "/v1/completions", body)
            assert response.status_code == 200, response.text
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            expected.append(min(common, len(ids) - 1) // block * block)
            assert cached == expected[-1], f"{engine}: {cached} cached, expected {expected}"
        assert expected[1] > expected[2] > 0
        total = len(ids_first) * 2 + len(ids_branch)
        wait_for_metric(engine, "vllm:prefix_cache_queries_total", queries + total)
        wait_for_metric(engine, "vllm:prefix_cache_hits_total", hits + sum(expected))
