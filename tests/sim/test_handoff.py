"""sysHAX-style handoff (--syshax-compat): prefill on a GPU engine, decode on a CPU engine, KV
through shared memory. The vLLM contract (SyshaxShmConnector) is in test_connector.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sim_procs import MODEL, SimFactory, SimProcess, start_sim, stop_sim
from sim_sse import post_sse

PROMPT = " ".join(f"p{i}" for i in range(128))


@dataclass
class Pair:
    gpu: SimProcess
    cpu: SimProcess
    shm: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("pair")
    shm = tmp / "shm"  # the shared IPC namespace of the two "containers"
    shm.mkdir()
    common = ["--model", MODEL, "--speed", "20", "--shm-dir", str(shm), "--syshax-compat"]
    gpu = start_sim(tmp, "gpu", "--device", "a100-80gb", "--engine-id", "gpu-a", *common)
    cpu = start_sim(tmp, "cpu", "--device", "kunpeng-920-7280z", "--engine-id", "cpu-a", *common)
    yield Pair(gpu, cpu, shm)
    stop_sim(gpu)
    stop_sim(cpu)


def post(sim: SimProcess, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{sim.url}{path}", json={"model": MODEL, **body}, timeout=30)


def prefill_syshax(sim: SimProcess, max_tokens: int = 40) -> tuple[str, str]:
    r = post(sim, {"prompt": PROMPT, "max_tokens": max_tokens, "num_decode_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "scheduled"
    text: str = body["choices"][0]["text"]
    assert len(text.split()) == 1
    return body["id"], text


def decode_syshax(sim: SimProcess, rid: str | None, text: str, n: int, left: int) -> httpx.Response:
    body: dict[str, Any] = {
        "prompt": PROMPT,
        "max_tokens": left,
        "num_decode_tokens": n,
        "generated_text": text,
    }
    if rid is not None:
        body["request_id_inference"] = rid
    return post(sim, body)


def segments(shm: Path) -> list[str]:
    return sorted(p.name for p in shm.iterdir())


def test_syshax_prefill_gpu_decode_cpu_then_back_to_gpu(pair: Pair) -> None:
    total = 40
    rid, text = prefill_syshax(pair.gpu, total)
    assert segments(pair.shm) == [f"syshax-kv-{rid}"]
    # Sized like the real KV: 128 prompt tokens x 256 KiB (64 layers x 8 KV heads x 128 x 2 x 2).
    assert (pair.shm / f"syshax-kv-{rid}").stat().st_size == 4096 + 128 * 262144

    r = decode_syshax(pair.cpu, rid, text, 10, total - 1)
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["id"] == rid
    assert body["choices"][0]["finish_reason"] == "scheduled"
    assert len(body["choices"][0]["text"].split()) == 10
    text += body["choices"][0]["text"]
    assert segments(pair.shm) == [f"syshax-kv-{rid}"]  # re-published by the CPU engine

    # Next chunk streams from the CPU engine.
    raw = post_sse(
        pair.cpu.port,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": total - 11, "num_decode_tokens": 9, "stream": True,
         "request_id_inference": rid, "generated_text": text},
    )  # fmt: skip
    events = raw.json_events()
    pieces = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["text"]]
    assert len(pieces) == 9
    assert events[-1]["choices"][0]["finish_reason"] == "scheduled"
    text += "".join(pieces)

    # The GPU engine maps the CPU engine's segment and finishes the sequence.
    r = decode_syshax(pair.gpu, rid, text, 100, total - 20)
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    text += body["choices"][0]["text"]
    assert len(text.split()) == total
    assert f"syshax-kv-{rid}" not in segments(pair.shm)  # a finished sequence leaves nothing

    cpu_log = httpx.get(f"{pair.cpu.url}/sim/requests").json()["requests"]
    assert [r["completion_tokens"] for r in cpu_log if r["request_id"] == rid] == [10, 9]
    # Generation is a function of the tokens: the handed-over sequence says what one
    # uninterrupted request says.
    whole = post(pair.gpu, {"prompt": PROMPT, "max_tokens": total}).json()
    assert whole["choices"][0]["text"] == text


def test_syshax_decode_pays_the_modelled_copy_cost(pair: Pair) -> None:
    rid, text = prefill_syshax(pair.gpu)
    r = decode_syshax(pair.cpu, rid, text, 39, 39)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    rec = [
        x
        for x in httpx.get(f"{pair.cpu.url}/sim/requests").json()["requests"]
        if x["request_id"] == rid
    ][-1]
    ttft_sim = (rec["first_token_at"] - rec["received_at"]) * 20
    # 128 tokens x 256 KiB at 20 GB/s = 1.7 ms of copy, then one CPU decode step of ~57 ms.
    assert 0.055 < ttft_sim < 0.2


def test_syshax_resume_without_id_recomputes_prefill(pair: Pair) -> None:
    rid, text = prefill_syshax(pair.gpu, 30)
    r = decode_syshax(pair.cpu, rid, text, 10, 29)
    text += r.json()["choices"][0]["text"]
    # Move back to the GPU by recomputation: no request_id_inference.
    r = decode_syshax(pair.gpu, None, text, 5, 19)
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "scheduled"
    new_id = body["id"]
    assert new_id != rid
    assert f"syshax-kv-{new_id}" in segments(pair.shm)
    rec = next(
        x
        for x in httpx.get(f"{pair.gpu.url}/sim/requests").json()["requests"]
        if x["request_id"] == new_id
    )
    assert rec["prompt_tokens"] == 128 + 11  # prompt + generated text were prefilled again
    # Clean up both leftovers so later tests see an empty namespace.
    text += body["choices"][0]["text"]
    assert (
        decode_syshax(pair.cpu, new_id, text, 100, 14).json()["choices"][0]["finish_reason"]
        == "length"
    )
    (pair.shm / f"syshax-kv-{rid}").unlink(missing_ok=True)


def error_of(r: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == r.status_code
    return err


def test_wrong_ids(pair: Pair) -> None:
    malformed = decode_syshax(pair.cpu, "../../etc/passwd", "x", 5, 5)
    assert malformed.status_code == 400 and error_of(malformed)["param"] == "request_id_inference"
    unknown = decode_syshax(pair.cpu, "cmpl-doesnotexist", "x", 5, 5)
    assert unknown.status_code == 404
    # A real id with another sequence's generated text: the token count does not match.
    rid, text = prefill_syshax(pair.gpu)
    mismatched = decode_syshax(pair.cpu, rid, text + " extra words", 5, 5)
    assert mismatched.status_code == 409
    message = error_of(mismatched)["message"]
    assert "holds 128 tokens" in message and "need 130" in message
    assert (
        decode_syshax(pair.cpu, rid, text, 100, 39).json()["choices"][0]["finish_reason"]
        == "length"
    )


def test_decode_outside_the_ipc_namespace_says_so(
    pair: Pair, sim_factory: SimFactory, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "other-ns"
    elsewhere.mkdir()
    lonely = sim_factory(
        "--device", "kunpeng-920-7280z", "--model", MODEL, "--shm-dir", str(elsewhere),
        "--syshax-compat",
    )  # fmt: skip
    rid, text = prefill_syshax(pair.gpu)
    r = decode_syshax(lonely, rid, text, 5, 39)
    assert r.status_code == 404
    err = error_of(r)
    assert "IPC namespace" in err["message"]
    assert str(elsewhere / f"syshax-kv-{rid}") in err["message"]
    assert err["type"] == "NotFoundError"
    assert (
        decode_syshax(pair.cpu, rid, text, 100, 39).json()["choices"][0]["finish_reason"]
        == "length"
    )


def test_request_id_inference_needs_generated_text(pair: Pair) -> None:
    r = post(pair.cpu, {"prompt": PROMPT, "request_id_inference": "cmpl-x", "num_decode_tokens": 3})
    assert r.status_code == 400 and error_of(r)["param"] == "generated_text"


def test_corrupt_segment_is_refused(pair: Pair) -> None:
    (pair.shm / "syshax-kv-cmpl-corrupt").write_bytes(b"\0" * 8192)
    r = decode_syshax(pair.cpu, "cmpl-corrupt", "x", 5, 5)
    assert r.status_code == 409 and "corrupt" in error_of(r)["message"]
    (pair.shm / "syshax-kv-cmpl-corrupt").unlink()


def test_other_model_cannot_map_the_kv(pair: Pair, sim_factory: SimFactory) -> None:
    seven_b = sim_factory(
        "--device",
        "kunpeng-920-7280z",
        "--model",
        "qwen2.5-7b-instruct",
        "--shm-dir",
        str(pair.shm),
        "--syshax-compat",
    )
    rid, text = prefill_syshax(pair.gpu)
    r = httpx.post(
        f"{seven_b.url}/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 5,
            "num_decode_tokens": 5,
            "request_id_inference": rid,
            "generated_text": text,
        },
    )
    assert r.status_code == 409 and MODEL in error_of(r)["message"]


def test_expired_lease_then_reclaimed(sim_factory: SimFactory, shm_dir: Path) -> None:
    common = [
        "--model",
        MODEL,
        "--speed",
        "20",
        "--shm-dir",
        str(shm_dir),
        "--kv-lease-seconds",
        "0.6",
        "--syshax-compat",
    ]
    gpu = sim_factory("--device", "a100-80gb", *common)
    cpu = sim_factory("--device", "kunpeng-920-7280z", *common)
    rid, text = prefill_syshax(gpu)
    time.sleep(0.9)  # past the lease, inside the reaper's grace of max(1 s, one lease)
    r = decode_syshax(cpu, rid, text, 5, 39)
    assert r.status_code == 410
    err = error_of(r)
    assert "expired" in err["message"] and err["type"] == "GoneError"

    # A leaked segment (nobody ever decodes it) is reclaimed after lease + grace.
    leaked, _ = prefill_syshax(gpu)
    path = shm_dir / f"syshax-kv-{leaked}"
    assert path.exists()
    deadline = time.monotonic() + 5
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.exists()
    reclaimed = int(gpu.info()["segments_reclaimed"]) + int(cpu.info()["segments_reclaimed"])  # type: ignore[call-overload]
    assert reclaimed >= 1


def test_sim_requests_since_and_limit(pair: Pair) -> None:
    for _ in range(3):
        post(pair.gpu, {"prompt": "a b", "max_tokens": 2})
    records = httpx.get(f"{pair.gpu.url}/sim/requests", params={"limit": 2}).json()["requests"]
    assert len(records) == 2
    everything = httpx.get(f"{pair.gpu.url}/sim/requests").json()["requests"]
    assert records == everything[-2:]
    later = httpx.get(f"{pair.gpu.url}/sim/requests", params={"since": time.time() + 1}).json()
    assert later["requests"] == []
    bad = httpx.get(f"{pair.gpu.url}/sim/requests", params={"limit": "x"})
    assert bad.status_code == 400
