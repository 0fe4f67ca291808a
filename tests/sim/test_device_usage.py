"""The modelled device's busy time and memory, as /sim/info reports them to node agents."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from sim_procs import MODEL, SimFactory, SimProcess

from common.presets import DEVICES, GIB, MODELS
from sim.perfmodel import (
    decode_step_time,
    device_memory_total_bytes,
    device_memory_used_bytes,
    effective_hardware,
    prefill_time,
)
from sim.stats import BusyMeter

Q32 = MODELS[MODEL]
A100 = DEVICES["a100-80gb"]
BLOCK = 16


def usage(sim: SimProcess) -> dict[str, float]:
    info = sim.info()
    assert isinstance(info["device"], str)  # the preset name, as before
    data = info["device_usage"]
    assert isinstance(data, dict)
    return data


def complete(sim: SimProcess, words: int, max_tokens: int) -> None:
    prompt = " ".join(f"w{i}" for i in range(words))
    r = httpx.post(
        f"{sim.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == words


def test_busy_meter_counts_a_running_step_up_to_now_and_nothing_between_steps() -> None:
    meter = BusyMeter()
    assert meter.busy_at(5.0) == 0.0
    meter.begin(10.0, 10.5)
    assert meter.busy_at(9.0) == 0.0  # (a reading cannot precede the step, but stays sane)
    assert meter.busy_at(10.2) == pytest.approx(0.2)
    assert meter.busy_at(11.0) == pytest.approx(0.5)  # never more than the step's duration
    meter.finish()
    assert meter.busy_at(100.0) == pytest.approx(0.5)
    meter.finish()  # a second finish adds nothing
    meter.begin(20.0, 20.25)
    meter.finish()
    assert meter.busy_at(100.0) == pytest.approx(0.75)


def test_memory_is_weights_plus_the_kv_held_and_total_spans_the_tp_group() -> None:
    assert device_memory_used_bytes(Q32, 0) == Q32.weight_bytes
    assert device_memory_used_bytes(Q32, 320) == Q32.weight_bytes + 320 * Q32.kv_bytes_per_token
    assert device_memory_total_bytes(A100) == 80 * GIB
    assert device_memory_total_bytes(A100, 2) == 160 * GIB
    cpu = DEVICES["kunpeng-920-7280z"]
    assert device_memory_total_bytes(cpu, 2) == cpu.memory_bytes  # ranks share host RAM


def test_busy_time_is_the_modelled_duration_of_every_step_and_zero_when_idle(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--device", "a100-80gb", "--model", MODEL, "--speed", "20")
    idle = usage(sim)
    assert idle["busy_seconds_total"] == 0.0
    assert idle["memory_used_bytes"] == int(Q32.weight_bytes)
    assert idle["memory_total_bytes"] == 80 * GIB
    assert idle["kv_blocks_in_use"] == 0
    time.sleep(0.3)
    later = usage(sim)
    assert later["busy_seconds_total"] == 0.0
    assert later["uptime_seconds"] - idle["uptime_seconds"] >= 0.3 * 20 * 0.9  # simulated s

    # One lone request: a whole-prompt prefill step (which samples the first token), then one
    # decode step per further token, each over a context one token longer.
    complete(sim, 40, 5)
    hw = effective_hardware(A100)
    expected = prefill_time(hw, Q32, 40) + sum(
        decode_step_time(hw, Q32, 1, 40 + k) for k in range(4)
    )
    light = usage(sim)
    assert light["busy_seconds_total"] == pytest.approx(expected, rel=1e-9)
    assert light["busy_seconds_total"] <= light["uptime_seconds"] - later["uptime_seconds"]

    # Eight concurrent long requests keep the device busy far longer.
    threads = [threading.Thread(target=complete, args=(sim, 2000, 100)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    heavy = usage(sim)
    grown = heavy["busy_seconds_total"] - light["busy_seconds_total"]
    assert grown > 20 * light["busy_seconds_total"]
    assert grown <= heavy["uptime_seconds"] - light["uptime_seconds"]
    assert heavy["kv_blocks_in_use"] == 0 and heavy["memory_used_bytes"] == int(Q32.weight_bytes)

    # Idle again: the device's busy time stands still while its clock runs on.
    time.sleep(0.3)
    rest = usage(sim)
    assert rest["busy_seconds_total"] == heavy["busy_seconds_total"]
    assert rest["uptime_seconds"] > heavy["uptime_seconds"]


def test_memory_in_use_follows_the_kv_of_running_sequences(sim_factory: SimFactory) -> None:
    sim = sim_factory("--device", "a100-80gb", "--model", MODEL, "--speed", "20")
    prompt = " ".join(f"w{i}" for i in range(1000))
    body = {"prompt": prompt, "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        for _ in range(20):  # some tokens in: the prompt's KV is held
            next(lines)
        running = usage(sim)
    blocks = running["kv_blocks_in_use"]
    assert blocks >= 1000 // BLOCK
    assert running["memory_used_bytes"] == int(
        Q32.weight_bytes + blocks * BLOCK * Q32.kv_bytes_per_token
    )
    assert running["memory_used_bytes"] > Q32.weight_bytes
    # The client left: the engine aborts the sequence and frees its blocks.
    deadline = time.monotonic() + 10
    while usage(sim)["kv_blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert usage(sim)["memory_used_bytes"] == int(Q32.weight_bytes)
