"""The PD contract of vLLM 0.32 with the SyshaxShmConnector: prefill on one engine, decode on
its peer from token ids plus kv_transfer_params, cached_tokens proving the KV was used, and
unusable transfers recomputed rather than refused."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sim_procs import MODEL, SimFactory, SimProcess, start_sim, stop_sim
from sim_sse import post_sse

from kvconnector.syshax_kv_shm import prompt_digest
from sim.connector import HEADER_SPACE

PROMPT = " ".join(f"p{i}" for i in range(128))
PARAM_KEYS = {
    "do_remote_prefill", "transfer_id", "segment", "num_tokens", "ranks", "lease_expires_at",
    "producer_engine_id", "ipc_namespace", "geometry", "remote_prefill_cached_tokens",
    "prompt_digest",
}  # fmt: skip


def kv_config(engine_id: str, peer: str, shm: Path, **extra: Any) -> str:
    return json.dumps(
        {
            "kv_connector": "SyshaxShmConnector",
            "kv_connector_module_path": "syshax_kv_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "shm_dir": str(shm), "lease_seconds": 30, "engine_id": engine_id,
                "peer_engine_id": peer, **extra,
            },
        }
    )  # fmt: skip


@dataclass
class Pair:
    gpu: SimProcess
    cpu: SimProcess
    shm: Path


def start_pair(
    factory: pytest.TempPathFactory, name: str, ids: tuple[str, str], *extra: str
) -> Pair:
    """A GPU and a CPU engine sharing a shm dir, the connector naming each the other's peer."""
    tmp = factory.mktemp(name)
    shm = tmp / "shm"
    shm.mkdir()
    common = ["--model", MODEL, "--speed", "20", "--enable-prompt-tokens-details", *extra]
    gpu = start_sim(
        tmp, "gpu", "--device", "a100-80gb", "--kv-transfer-config",
        kv_config(ids[0], ids[1], shm), *common,
    )  # fmt: skip
    cpu = start_sim(
        tmp, "cpu", "--device", "kunpeng-920-7280z", "--kv-transfer-config",
        kv_config(ids[1], ids[0], shm), *common,
    )  # fmt: skip
    return Pair(gpu, cpu, shm)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    # The connector alone: without the local prefix cache, whose hits on a prompt sent twice
    # would hide what the connector loaded (``caching_pair`` below has both).
    started = start_pair(
        tmp_path_factory, "connector", ("gpu-a", "cpu-a"), "--no-enable-prefix-caching"
    )
    yield started
    stop_sim(started.gpu)
    stop_sim(started.cpu)


@pytest.fixture(scope="module")
def caching_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    started = start_pair(tmp_path_factory, "caching", ("gpu-c", "cpu-c"))
    yield started
    stop_sim(started.gpu)
    stop_sim(started.cpu)


def post(sim: SimProcess, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    r = httpx.post(f"{sim.url}{path}", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def prefill(sim: SimProcess, prompt: Any = PROMPT, path: str = "/v1/completions") -> Any:
    field = "messages" if path.endswith("chat/completions") else "prompt"
    return post(
        sim,
        {field: prompt, "max_tokens": 1, "return_token_ids": True,
         "kv_transfer_params": {"do_remote_decode": True}},
        path,
    )  # fmt: skip


def decode_body(answer: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """The router's decode request: prompt ids + the sampled token, the params minus
    remote_prefill_cached_tokens."""
    choice = answer["choices"][0]
    prompt_ids = choice.get("prompt_token_ids") or answer["prompt_token_ids"]
    params = {k: v for k, v in answer["kv_transfer_params"].items()
              if k != "remote_prefill_cached_tokens"}  # fmt: skip
    return {
        "prompt": prompt_ids + choice["token_ids"],
        "max_tokens": max_tokens,
        "return_token_ids": True,
        "kv_transfer_params": params,
        **extra,
    }


def metric(sim: SimProcess, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{sim.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def files(shm: Path) -> list[str]:
    return sorted(p.name for p in shm.iterdir())


def test_prefill_then_streamed_decode_on_the_peer_uses_the_transferred_kv(pair: Pair) -> None:
    answer = prefill(pair.gpu)
    params = answer["kv_transfer_params"]
    assert set(params) == PARAM_KEYS
    assert params["num_tokens"] == 128 and params["producer_engine_id"] == "gpu-a"
    assert params["remote_prefill_cached_tokens"] == 0 and params["ranks"] == 1
    # Bound to its prompt as the connector binds it: the served model and the token ids.
    choice = answer["choices"][0]
    prompt_ids = choice.get("prompt_token_ids") or answer["prompt_token_ids"]
    assert params["prompt_digest"] == prompt_digest(prompt_ids, answer["model"], None), params
    # The answer may come before the copy lands (a .tmp segment); then it is published.
    deadline = time.monotonic() + 5
    while files(pair.shm) != [params["segment"]] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert files(pair.shm) == [params["segment"]]
    # Sized like the real KV (sparse): 128 tokens x 256 KiB behind the header.
    assert (pair.shm / params["segment"]).stat().st_size == HEADER_SPACE + 128 * 262144
    hits_before = metric(pair.cpu, "vllm:external_prefix_cache_hits_total")

    raw = post_sse(
        pair.cpu.port,
        "/v1/completions",
        decode_body(answer, 9, stream=True, stream_options={"include_usage": True}),
    )
    events = raw.json_events()
    ids = [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 128}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (129, 9)
    assert files(pair.shm) == []  # claimed and consumed
    assert metric(pair.cpu, "vllm:external_prefix_cache_hits_total") == hits_before + 128
    assert metric(pair.cpu, "vllm:prompt_tokens_cached_total") >= 128

    # The same tokens as one uninterrupted request on the prefill engine.
    whole = post(pair.gpu, {"prompt": PROMPT, "max_tokens": 10, "return_token_ids": True})
    assert answer["choices"][0]["token_ids"] + ids == whole["choices"][0]["token_ids"]


def test_the_decode_pays_the_modelled_copy_before_its_first_token(pair: Pair) -> None:
    answer = prefill(pair.gpu)
    decoded = post(pair.cpu, decode_body(answer, 3))
    rec = next(
        r
        for r in httpx.get(f"{pair.cpu.url}/sim/requests").json()["requests"]
        if r["request_id"] == decoded["id"]
    )
    ttft_sim = (rec["first_token_at"] - rec["received_at"]) * 20
    # 128 tokens x 256 KiB at 20 GB/s = 1.7 ms of copy, then one CPU step of ~57 ms for the
    # one token not transferred: far below the ~570 ms of prefilling 129 tokens.
    assert 0.055 < ttft_sim < 0.2


def test_chat_prefill_continues_as_a_completion(pair: Pair) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    answer = prefill(pair.gpu, messages, "/v1/chat/completions")
    assert "prompt_token_ids" not in answer["choices"][0]
    assert len(answer["prompt_token_ids"]) == answer["kv_transfer_params"]["num_tokens"]
    decoded = post(pair.cpu, decode_body(answer, 5))
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == len(
        answer["prompt_token_ids"]
    )
    whole = post(
        pair.gpu,
        {"messages": messages, "max_tokens": 6, "return_token_ids": True},
        "/v1/chat/completions",
    )
    got = answer["choices"][0]["token_ids"] + decoded["choices"][0]["token_ids"]
    assert got == whole["choices"][0]["token_ids"]


def test_remote_prefill_cached_tokens_overrides_cached_tokens(pair: Pair) -> None:
    answer = prefill(pair.gpu)
    body = decode_body(answer, 2)
    body["kv_transfer_params"]["remote_prefill_cached_tokens"] = 7
    decoded = post(pair.cpu, body)
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == 7  # as vLLM reports
    assert files(pair.shm) == []  # the KV was still loaded


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        ({"producer_engine_id": "gpu-b"}, "produced by engine 'gpu-b'"),
        ({"ipc_namespace": "ipc:[1]"}, "IPC namespace ipc:[1]"),
        ({"geometry": {"layers": 2}}, "geometry"),
        ({"lease_expires_at": int(time.time()) - 5}, "expired"),
        ({"transfer_id": "0" * 32}, "not found"),
        ({"transfer_id": "zz"}, "not a syshax transfer id"),
    ],
)
def test_an_unusable_transfer_is_recomputed_not_refused(
    pair: Pair, change: dict[str, Any], cause: str
) -> None:
    answer = prefill(pair.gpu)
    good = decode_body(answer, 4)
    bad = {**good, "kv_transfer_params": {**good["kv_transfer_params"], **change}}
    hits_before = metric(pair.cpu, "vllm:external_prefix_cache_hits_total")
    recomputed = post(pair.cpu, bad)
    assert cause in recomputed["kv_transfer_params"]["syshax_kv_error"]
    assert recomputed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(pair.cpu, "vllm:external_prefix_cache_hits_total") == hits_before
    logged = [ln for ln in pair.cpu.log_text().splitlines() if recomputed["id"] in ln]
    assert len(logged) == 1 and " ERROR " in logged[0] and cause in logged[0]
    # The right request still finds its segment, and both produce the same tokens.
    used = post(pair.cpu, good)
    assert used["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    assert used["kv_transfer_params"] is None
    assert used["choices"][0]["token_ids"] == recomputed["choices"][0]["token_ids"]


def test_a_transfer_is_used_once(pair: Pair) -> None:
    body = decode_body(prefill(pair.gpu), 2)
    assert post(pair.cpu, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    again = post(pair.cpu, body)
    assert "not found" in again["kv_transfer_params"]["syshax_kv_error"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_streamed_prefill_publishes_but_streams_no_params(pair: Pair) -> None:
    raw = post_sse(
        pair.gpu.port,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 1, "stream": True,
         "kv_transfer_params": {"do_remote_decode": True}},
    )  # fmt: skip
    events = raw.json_events()
    assert len(events) == 1 and events[0]["choices"][0]["finish_reason"] == "length"
    assert not any("kv_transfer_params" in e for e in events)
    # The segment is published beside the stream (written to a .tmp name, then renamed):
    # wait for the rename rather than catch the file half-way.
    deadline = time.monotonic() + 10
    published = files(pair.shm)
    while any(name.endswith(".tmp") for name in published) and time.monotonic() < deadline:
        time.sleep(0.05)
        published = files(pair.shm)
    assert len(published) == 1 and not published[0].endswith(".tmp"), published
    (pair.shm / published[0]).unlink()  # left to its lease, as vLLM's connector leaves it


def test_an_engine_without_the_connector_ignores_kv_transfer_params(
    sim_factory: SimFactory, shm_dir: Path
) -> None:
    sim = sim_factory("--device", "a100-80gb", "--model", MODEL, "--shm-dir", str(shm_dir))
    answer = prefill(sim)
    assert answer["kv_transfer_params"] is None
    assert files(shm_dir) == []
    assert answer["usage"]["prompt_tokens_details"] is None  # no --enable-prompt-tokens-details


def test_the_connector_json_wins_and_its_lease_is_reaped(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    shm = tmp_path / "connector-shm"  # created by the engine, as the connector does
    sim = sim_factory(
        "--device", "a100-80gb", "--model", MODEL, "--engine-id", "from-flag",
        "--shm-dir", str(tmp_path), "--kv-lease-seconds", "30",
        "--kv-transfer-config", kv_config("from-json", "", shm, lease_seconds=0.5),
    )  # fmt: skip
    info = sim.info()
    assert info["engine_id"] == "from-json" and info["shm_dir"] == str(shm)
    assert info["kv_lease_seconds"] == 0.5
    assert 'engine="from-json"' in httpx.get(f"{sim.url}/metrics").text
    prefill(sim)
    assert len(files(shm)) == 1
    deadline = time.monotonic() + 5
    while files(shm) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert files(shm) == []  # the lease ended and the reaper unlinked it


def test_a_decode_whose_prefix_the_cpu_caches_loads_only_what_it_lacks(caching_pair: Pair) -> None:
    """A follow-up turn: the CPU engine's prefix cache holds the shared start of the prompt,
    so the connector loads only the rest (vLLM asks the connector for the tokens beyond the
    local hits), and cached_tokens counts both."""
    gpu, cpu = caching_pair.gpu, caching_pair.cpu
    shared = [f"s{i}" for i in range(96)]
    first = prefill(gpu, " ".join(shared + [f"a{i}" for i in range(32)]))
    post(cpu, decode_body(first, 2))
    local, external = (
        metric(cpu, "vllm:prefix_cache_hits_total"),
        metric(cpu, "vllm:external_prefix_cache_hits_total"),
    )
    second = prefill(gpu, " ".join(shared + [f"b{i}" for i in range(32)]))
    # The GPU's own cache served the shared 96 tokens of the prefill (six whole blocks).
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    decoded = post(cpu, decode_body(second, 2))
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    assert metric(cpu, "vllm:prefix_cache_hits_total") == local + 96
    assert metric(cpu, "vllm:external_prefix_cache_hits_total") == external + 32
    # The same prompt once more on one engine: every whole block but the last token's hits.
    again = post(gpu, {"prompt": " ".join(shared), "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
