"""An attacker's ``kv_transfer_params`` sent straight to each engine's own port, past the
router (which strips them): each engine answers every body for itself (a recompute, a
fallback or a 4xx, never a 5xx), is still alive afterwards, and still hands a good transfer
from the GPU engine to the CPU engine. A segment spoiled after the decode's checks passed
(the worker's load fails) is recomputed too, with its cause in the engine's log.

Both kinds of the ``engines`` fixture: the simulator runs the connector's own checks
(``syshax_kv_shm.check_params``), so it must hold the same way.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import pytest

from tests.realengine.conftest import LEASE_SECONDS, Pair, segments
from tests.realengine.test_pd import PROMPT, _prefill
from tests.router.router_procs import wait_for

# JSON a Python client cannot write with json.dumps: the raw number, as an attacker types it.
RAW_NUMBERS = {"@1e999@": "1e999", "@-1e999@": "-1e999", "@NaN@": "NaN", "@huge@": "9" * 400}

# Spoiled fields of a real transfer's parameters, for the CPU (decode) engine.
DECODE_SPOILS: dict[str, dict[str, Any]] = {
    "lease the string nan": {"lease_expires_at": "nan"},
    "lease NaN": {"lease_expires_at": "@NaN@"},
    "lease 1e999": {"lease_expires_at": "@1e999@"},
    "lease -1e999": {"lease_expires_at": "@-1e999@"},
    "lease negative": {"lease_expires_at": -1},
    "lease a 400-digit integer": {"lease_expires_at": "@huge@"},
    "lease in a year": {"lease_expires_at": int(time.time()) + 365 * 86400},
    "ranks 0": {"ranks": 0},
    "ranks 999": {"ranks": 999},
    "ranks a string": {"ranks": "1"},
    "num_tokens past the prompt": {"num_tokens": 10**9},
    "num_tokens negative": {"num_tokens": -1},
    "transfer_id a path": {"transfer_id": "../../../../etc/passwd"},
    "transfer_id a list": {"transfer_id": ["x"]},
    "producer a path": {"producer_engine_id": "../../gpu"},
    "namespace a list": {"ipc_namespace": ["ipc:[1]"]},
    "geometry with a float": {"geometry": "@float-layers@"},
    "geometry a string": {"geometry": "tiny"},
}
# Whole kv_transfer_params for the GPU (prefill) engine.
PREFILL_BODIES: dict[str, Any] = {
    "do_remote_decode a string": {"do_remote_decode": "yes"},
    "do_remote_decode a list": {"do_remote_decode": [True]},
    "do_remote_decode with a lease of its own": {
        "do_remote_decode": True,
        "lease_expires_at": "@1e999@",
        "lease_seconds": 10**9,
        "ranks": 0,
        "transfer_id": "../../x",
    },
    "a decode's fields, made up": {
        "transfer_id": "0" * 32,
        "ranks": 0,
        "lease_expires_at": "@NaN@",
        "num_tokens": 3,
    },
    "not an object": "do_remote_decode",
    "a list": [{"do_remote_decode": True}],
}


def _post_raw(url: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` with its ``"@…@"`` markers written as raw JSON numbers."""
    text = json.dumps(body)
    for marker, raw in RAW_NUMBERS.items():
        text = text.replace(f'"{marker}"', raw)
    return httpx.post(
        url + "/v1/completions",
        content=text,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )


def _decode_body(prefill: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    choice = prefill["choices"][0]
    return {
        "model": "tiny",
        "prompt": choice["prompt_token_ids"] + choice["token_ids"],
        "max_tokens": 4,
        "temperature": 0,
        "kv_transfer_params": params,
    }


def _clean(prefill: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in prefill["kv_transfer_params"].items()
        if k != "remote_prefill_cached_tokens"
    }


def _assert_held(engine: Any, response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{engine.name} on {what}: {response.text[:500]}"
    assert engine.alive(), f"{engine.name} died on {what}:\n{engine.tail()}"


def test_both_engines_hold_against_hostile_transfer_parameters(engines: Pair) -> None:
    prefill = _prefill(engines)
    params = _clean(prefill)
    float_layers = {**params["geometry"], "layers": float(params["geometry"]["layers"])}
    for what, spoil in DECODE_SPOILS.items():
        bad = {**params, **spoil}
        if bad.get("geometry") == "@float-layers@":
            bad["geometry"] = float_layers
        r = _post_raw(engines.cpu.url, _decode_body(prefill, bad))
        _assert_held(engines.cpu, r, what)
        if r.status_code == 200:  # refused by the connector, not by the API: recomputed
            data = r.json()
            assert set(data["kv_transfer_params"] or {}) == {"syshax_kv_error"}, (what, data)
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] < params["num_tokens"]
    for what, kv in PREFILL_BODIES.items():
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": kv}
        r = _post_raw(engines.gpu.url, body)
        _assert_held(engines.gpu, r, what)
        answer = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        if isinstance(answer, dict) and "lease_expires_at" in answer:
            # The engine's own lease, whatever the client asked for.
            assert answer["lease_expires_at"] <= math.ceil(time.time()) + LEASE_SECONDS + 1
            assert answer["ranks"] == 1 and answer["transfer_id"] != "../../x"
    # The transfer the spoiled decodes named is intact: its own decode loads it. Its
    # "segment" is never read (file names come from the checked transfer id), so a path
    # there changes nothing.
    params["segment"] = "../../../../etc/passwd"
    good = httpx.post(engines.cpu.url + "/v1/completions", json=_decode_body(prefill, params))
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= params["num_tokens"]
    # Both engines answer a plain request, and hand over a fresh transfer.
    for engine in (engines.gpu, engines.cpu):
        plain = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        r = httpx.post(engine.url + "/v1/completions", json=plain, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    again = _prefill(engines)
    r = httpx.post(engines.cpu.url + "/v1/completions", json=_decode_body(again, _clean(again)))
    assert r.status_code == 200, r.text
    assert (
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= again["usage"]["prompt_tokens"] - 1
    )
    # What the hostile prefills published goes with its lease: nothing is held longer.
    wait_for(lambda: not segments(engines.shm), timeout=LEASE_SECONDS + 10, interval=0.2)


@pytest.mark.parametrize("damage", [b"garbage", b"SYSHAXKV" + b"\xff" * 8])
def test_a_segment_spoiled_after_the_checks_is_recomputed(engines: Pair, damage: bytes) -> None:
    """The decode's parameters pass every check and its segment exists, but what the load
    reads is not a segment: the load fails on the worker and the prompt is recomputed (vLLM's
    kv_load_failure_policy, which the connector sets to recompute), never an error."""
    prefill = _prefill(engines)
    params = _clean(prefill)
    segment = engines.shm / params["segment"]
    wait_for(segment.exists, timeout=30, interval=0.05)  # published once its copy landed
    segment.write_bytes(damage)
    log_from = len(engines.cpu.log_text())
    r = httpx.post(
        engines.cpu.url + "/v1/completions", json=_decode_body(prefill, params), timeout=120
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert "syshax_kv_error" in (data["kv_transfer_params"] or {}), data
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] < params["num_tokens"]
    assert data["choices"][0]["text"]
    new_log = engines.cpu.log_text()[log_from:]
    assert "SyshaxShmConnector cpu" in new_log, new_log[-3000:]
    assert "not a syshax KV segment" in new_log or "format" in new_log, new_log[-3000:]
    assert engines.cpu.alive()
    assert not segment.exists()  # unlinked with the failed load
