"""The simulator's KV events (``--kv-events-config``): vLLM's wire format and publisher."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from sim_procs import MODEL, SimFactory

from common.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    batch_decoder,
    engine_kv_events_url,
    parse_kv_events_config,
    subscriber_url,
)
from common.supervisor import free_port
from sim.kv_events import KvEventPublisher, wire_events

# vLLM 0.32's bytes for KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[2**63 + 5],
# parent_block_hash=None, token_ids=[1, 2], block_size=16, lora_id=None, medium="GPU",
# lora_name=None, extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention"),
# BlockRemoved([7], "GPU", group_idx=0),
# AllBlocksCleared()], data_parallel_rank=0), encoded by vLLM's own structs.
VLLM_BYTES = (
    b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\x8b\xa4type\xabBlockStored\xacblock_hash"
    b"es\x91\xcf\x80\x00\x00\x00\x00\x00\x00\x05\xb1parent_block_hash\xc0\xa9token_id"
    b"s\x92\x01\x02\xaablock_size\x10\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lor"
    b"a_name\xc0\xaaextra_keys\x91\xc0\xa9group_idx\x00\xb2kv_cache"
    b"_spec_kind\xaefull_attention\x84\xa4type\xacBlockRem"
    b"oved\xacblock_hashes\x91\x07\xa6medium\xa3GPU\xa9group_idx"
    b"\x00\x81\xa4type\xb0AllBlocksCleared\x00"
)


def test_the_structs_encode_as_vllms_do() -> None:
    events = wire_events(
        [
            ("stored", [-(2**63) + 5], None, [1, 2]),
            ("removed", [7], None, []),
            ("cleared", [], None, []),
        ],
        block_size=16,
    )
    assert msgspec.msgpack.encode(KVEventBatch(1.5, events, 0)) == VLLM_BYTES
    decoded = batch_decoder().decode(VLLM_BYTES)
    assert isinstance(decoded.events[0], BlockStored)
    assert decoded.events[0].block_hashes == [2**63 + 5]  # unsigned 64-bit, as vLLM sends
    assert isinstance(decoded.events[1], BlockRemoved)


def test_the_config_is_vllms() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert config.publisher == "zmq" and config.endpoint == "tcp://*:5557" and config.publishes
    assert not parse_kv_events_config("{}").publishes  # publisher "null", as vLLM defaults
    for bad, word in [
        ("[]", "object"),
        ('{"endpiont": "x"}', "unknown key 'endpiont'"),
        ('{"hwm": "10"}', "'hwm' must be int"),
        ('{"hwm": true}', "'hwm' must be int"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"max_queue_size": 0}', "max_queue_size"),
    ]:
        with pytest.raises(ValueError, match=word):
            parse_kv_events_config(bad)


def test_a_routers_url_names_the_engines_host() -> None:
    assert subscriber_url("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert subscriber_url("tcp://node-3:5557", "http://10.0.0.7:8000") == "tcp://node-3:5557"
    assert subscriber_url("tcp://*:0", "http://h:1") is None
    assert subscriber_url("ipc:///tmp/kv", "http://h:1") is None


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    config = parse_kv_events_config(
        json.dumps(
            {"enable_kv_cache_events": True, "endpoint": "inproc://full", "max_queue_size": 1}
        )
    )
    publisher = KvEventPublisher(config, block_size=16)
    try:
        publisher._queue.put_nowait(None)  # the thread stops reading: the queue stays full
        publisher._thread.join(timeout=2)
        started = time.monotonic()
        for _ in range(100):
            publisher.publish([("removed", [1], None, [])])
        assert time.monotonic() - started < 0.5
        assert publisher.dropped_total >= 99
    finally:
        publisher.close()


def subscribe(url: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(url)
    return sock


def receive(sock: zmq.Socket[bytes], quiet_s: float = 1.0) -> list[list[bytes]]:
    """Every message until none comes for ``quiet_s``."""
    messages = []
    while sock.poll(int(quiet_s * 1000)):
        messages.append(sock.recv_multipart())
    return messages


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    answer: dict[str, Any] = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    return answer


@pytest.mark.timeout(60)
def test_the_simulator_publishes_each_step_s_blocks(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    port, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    sim = sim_factory(
        "--device", "a100-80gb", "--model", MODEL, "--speed", "20",
        "--kv-events-config", json.dumps(config),
    )  # fmt: skip
    sock = subscribe(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # a SUB socket hears only what is sent after it joined
    prompt = [100 + i for i in range(300)]
    complete(sim.url, prompt)
    first = receive(sock)
    complete(sim.url, prompt)  # all cached: vLLM reports no reused blocks (incremental mode)
    second = receive(sock)
    assert first and not second
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in first]
    assert seqs == list(range(len(first)))
    assert {topic for topic, _, _ in first} == {b"kv"}
    stored = [
        event
        for *_, payload in first
        for event in batch_decoder().decode(payload).events
        if isinstance(event, BlockStored)
    ]
    # Prompt and output blocks whose KV was computed: (300 + 4 - 1) // 16.
    assert sum(len(e.block_hashes) for e in stored) == 303 // 16
    assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt[: 18 * 16]
    assert all(e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
    assert all(0 <= h < 2**64 for e in stored for h in e.block_hashes)
    info = sim.info()["kv_events"]
    assert isinstance(info, dict) and info["published_total"] == len(first)
    assert info["dropped_total"] == 0
    sock.close()

    # The replay socket sends the kept batches again from the seq asked, then the end marker.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while dealer.poll(5000):
        _, topic, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        replayed.append([topic, seq, payload])
    dealer.close()
    assert replayed == first


def test_a_deployment_s_url_comes_from_the_engine_s_flag() -> None:
    flag = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    url = "http://10.0.0.2:7001"
    assert engine_kv_events_url(["--kv-events-config", flag], url) == "tcp://10.0.0.2:5557"
    assert engine_kv_events_url([f"--kv-events-config={flag}"], url) == "tcp://10.0.0.2:5557"
    assert engine_kv_events_url(["--kv-events-config", "{}"], url) is None  # publishes none
    assert engine_kv_events_url(["--kv-events-config", "{oops"], url) is None
    assert engine_kv_events_url([], url) is None
