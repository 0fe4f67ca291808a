"""KV events against real vLLM 0.32: the simulator's ``--kv-events-config`` publishes what a real
engine does, in the same framing and structs, counted in each engine's own block size.

One real engine (the tiny model on one CPU) and one simulator, each publishing on a free port;
the same prompt of token ids sent twice to both. Compared: the multipart framing (topic, an
8-byte seq from 0 going up by one, payload), the batch and event field names in order and
their value types, and the number of distinct blocks stored: (prompt + output - 1) // the
engine's block size (``vllm:cache_config_info``), since the last output token's KV is never
computed and the second request finds the whole prefix cached.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.supervisor import ReadyChild, free_port, python_argv
from testbed import vllm_env

pytestmark = pytest.mark.timeout(1200)
ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
PROMPT = [100 + i for i in range(300)]
MAX_TOKENS = 4
TOPIC = "kv"


class Sim(ReadyChild):
    pass


Engine = vllm_env.VllmEngine | Sim


def events_config(port: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "topic": TOPIC,
        }
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-events")


@pytest.fixture(scope="module")
def publishers(workdir: Path) -> Iterator[list[tuple[Engine, int]]]:
    real_port, sim_port = free_port(), free_port()
    real = vllm_env.VllmEngine(
        "real",
        free_port(),
        workdir,
        cpus="1",
        extra_args=("--kv-events-config", events_config(real_port)),
    )
    argv = python_argv(
        "sim", "--device", "a100-80gb", "--model", "qwen2.5-7b-instruct",
        "--served-model-name", MODEL, "--max-model-len", "2048", "--speed", "20",
        "--kv-events-config", events_config(sim_port),
    )  # fmt: skip
    sim = Sim("sim", argv, workdir, cwd=ROOT, timeout=30)
    try:
        real.wait_ready()
        yield [(real, real_port), (sim, sim_port)]
    finally:
        sim.stop()
        real.stop()


def block_size(engine: Engine) -> int:
    text = httpx.get(engine.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            return int(family.samples[0].labels["block_size"])
    raise AssertionError("no vllm:cache_config_info")


def published(engine: Engine, port: int) -> list[list[bytes]]:
    """What the engine publishes while it serves PROMPT twice."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(1.0)  # a SUB socket hears only what is sent after it joined
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    messages = []
    for _ in range(2):
        answer = httpx.post(engine.url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        while sock.poll(2000):
            messages.append(sock.recv_multipart())
    sock.close()
    return messages


def shape(value: Any) -> Any:
    """Keys in order and value types, recursively (lists by their first element)."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def test_both_publish_the_same_events_in_their_own_block_size(
    publishers: list[tuple[Engine, int]],
) -> None:
    seen = {}
    for engine, port in publishers:
        size = block_size(engine)
        messages = published(engine, port)
        assert messages, f"{engine.name}: no KV events"
        assert all(len(m) == 3 and m[0] == TOPIC.encode() for m in messages)
        seqs = [int.from_bytes(m[1], "big") for m in messages]
        assert all(len(m[1]) == 8 for m in messages)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        batches = [msgspec.msgpack.decode(m[2]) for m in messages]
        stored = [e for b in batches for e in b[1] if e["type"] == "BlockStored"]
        hashes = {h for e in stored for h in e["block_hashes"]}
        assert len(hashes) == (len(PROMPT) + MAX_TOKENS - 1) // size, (engine.name, size)
        assert all(e["block_size"] == size for e in stored)
        assert all(len(e["token_ids"]) == size * len(e["block_hashes"]) for e in stored)
        assert stored[0]["parent_block_hash"] is None
        assert stored[0]["token_ids"] == PROMPT[: size * len(stored[0]["block_hashes"])]
        seen[engine.name] = (shape(batches[0][:1] + batches[0][2:]), shape(stored[0]), size)
    assert seen["sim"][0] == seen["real"][0]  # [ts, (events), data_parallel_rank]
    assert seen["sim"][1] == seen["real"][1]
    assert (seen["sim"][2], seen["real"][2]) == (16, 128)
