"""A simulated card's heartbeat figures come from the simulator engine that runs on it.

The engines here are real ``syshax sim`` processes started through the executor and the
process runtime; the agent reads their ``/sim/info`` as it does on every beat.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_helpers import free_port, http_engine_spec
from standin_control_plane import StandInControlPlane
from test_agent_loop import AgentProcess, wait_for

from agents.commands import CommandExecutor
from agents.discovery import (
    CardLoad,
    DeviceReading,
    EngineOnCards,
    SimulatedLoadReader,
    collect_heartbeat,
    collect_inventory,
    combine_card_loads,
    modelled_temperature_c,
    simulated_load,
    utilisation_percent,
)
from agents.main import Agent, AgentConfig
from agents.runtimes.process import ProcessRuntime
from common.presets import MODELS

MODEL = "deepseek-r1-distill-qwen-32b"
WEIGHTS = int(MODELS[MODEL].weight_bytes)
GIB = 1024**3


def sim_engine_spec(card: str, speed: float = 10.0) -> dict[str, Any]:
    port = free_port()
    command = [
        sys.executable, "-m", "syshax.cli", "sim", "--device", "a100-80gb", "--model", MODEL,
        "--port", str(port), "--speed", str(speed),
    ]  # fmt: skip
    return {
        "command": command,
        "port": port,
        "accelerators": [{"uuid": card, "simulated": True}],
        "health_timeout_seconds": 30,
    }


def start(executor: CommandExecutor, spec: dict[str, Any], deployment: int = 1) -> None:
    result = executor.execute(
        dispatch_id=str(uuid.uuid4()),
        action="start",
        deployment_id=deployment,
        generation=1,
        role="gpu",
        spec=spec,
    )
    assert result["status"] == "succeeded", result["detail"]


def load(url: str, requests: int, words: int, max_tokens: int) -> list[threading.Thread]:
    """Concurrent long completions against a simulator, in daemon threads."""

    def one() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the engine may be stopped mid-request
            httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "w " * words, "max_tokens": max_tokens},
                timeout=120,
            )

    threads = [threading.Thread(target=one, daemon=True) for _ in range(requests)]
    for t in threads:
        t.start()
    return threads


def engine_usage(url: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{url}/sim/info", timeout=5).json()["device_usage"]
    return data


# ---------------------------------------------------------------- pure calculations


def test_utilisation_is_busy_time_over_elapsed_simulated_time_since_the_last_reading() -> None:
    before = DeviceReading(busy_seconds=10.0, uptime_seconds=100.0, memory_used_bytes=0)
    after = DeviceReading(busy_seconds=13.0, uptime_seconds=104.0, memory_used_bytes=0)
    assert utilisation_percent(before, after) == pytest.approx(75.0)
    # First reading: the engine's whole life is the window.
    assert utilisation_percent(None, after) == pytest.approx(100.0 * 13 / 104)
    # The engine restarted (its clock went back): same rule, not a negative figure.
    restarted = DeviceReading(busy_seconds=1.0, uptime_seconds=4.0, memory_used_bytes=0)
    assert utilisation_percent(after, restarted) == pytest.approx(25.0)
    # Clamped, and no division by a zero window.
    assert utilisation_percent(before, DeviceReading(20.0, 101.0, 0)) == 100.0
    assert utilisation_percent(before, before) == pytest.approx(10.0)
    assert utilisation_percent(None, DeviceReading(0.0, 0.0, 0)) == 0.0


def test_card_loads_split_tensor_parallel_memory_and_add_engines_sharing_a_card() -> None:
    loads = combine_card_loads(
        [
            (("A", "B"), 60.0, 100 * GIB),  # TP 2: both cards busy, half the memory each
            (("B",), 70.0, 4 * GIB),  # a second engine on card B
            ((), 50.0, GIB),  # no card: ignored
        ]
    )
    assert loads["A"] == CardLoad(60.0, 50 * GIB)
    assert loads["B"] == CardLoad(100.0, 54 * GIB)  # 130 % capped
    assert set(loads) == {"A", "B"}


def test_an_idle_simulated_card_and_the_modelled_temperature() -> None:
    (card,) = collect_inventory(node_name="n", simulated=["a100-80gb"])["accelerators"]
    idle = simulated_load(card, None)
    assert (idle["utilization_percent"], idle["simulated"]) == (0.0, True)
    assert idle["memory_used_bytes"] == int(80 * GIB * 0.01)
    assert idle["temperature_c"] == modelled_temperature_c(0.0) == 32.0
    busy = simulated_load(card, CardLoad(100.0, 90 * GIB))
    assert busy["memory_used_bytes"] == 80 * GIB  # never more than the card has
    assert busy["temperature_c"] == 77.0


# ---------------------------------------------------------------- against real engines


@pytest.fixture
def agent(process_runtime: ProcessRuntime, tmp_path: Path) -> Iterator[Agent]:
    """The agent's heartbeat side, in process, on node-a with two simulated A100s.

    No control plane is contacted: the test calls the same functions ``Agent.beat`` does.
    """
    config = AgentConfig(
        control_plane="http://127.0.0.1:9", token="unused", state_dir=tmp_path / "agent"
    )
    a = Agent(config, runtime=process_runtime)
    a.node_name = "node-a"  # the executor fixture's node
    a.inventory = collect_inventory(node_name="node-a", simulated=["a100-80gb", "a100-80gb"])
    yield a
    a.sim_loads.close()
    a.client.close()


def beat(agent: Agent) -> list[dict[str, Any]]:
    loads = agent.sim_loads.read(agent.engines_on_simulated_cards())
    cards: list[dict[str, Any]] = collect_heartbeat(agent.inventory, simulated_loads=loads)[
        "accelerators"
    ]
    return cards


@pytest.mark.process
def test_a_card_reports_its_simulator_engines_busy_time_and_memory(
    agent: Agent, executor: CommandExecutor
) -> None:
    card0 = agent.inventory["accelerators"][0]["uuid"]
    assert [c["utilization_percent"] for c in beat(agent)] == [0.0, 0.0]  # no engine yet

    spec = sim_engine_spec(card0)
    start(executor, spec)
    url = f"http://127.0.0.1:{spec['port']}"
    (engine,) = agent.engines_on_simulated_cards()
    assert engine.cards == (card0,) and engine.endpoint == url

    # An engine with nothing to do: the card holds the model's weights and is idle.
    on, off = beat(agent)
    assert (on["utilization_percent"], on["memory_used_bytes"]) == (0.0, WEIGHTS)
    assert off["utilization_percent"] == 0.0 and off["memory_used_bytes"] < GIB

    # Six long requests keep the engine busy for seconds of wall time.
    threads = load(url, requests=6, words=1000, max_tokens=1500)
    wait_for(lambda: engine_usage(url)["kv_blocks_in_use"] > 0, what="requests running")
    beat(agent)  # the next window lies inside the load
    time.sleep(0.5)
    on, off = beat(agent)
    assert on["utilization_percent"] > 20.0  # back-to-back steps: ~100 % unless the host lags
    assert on["memory_used_bytes"] > WEIGHTS  # the running sequences' KV blocks
    assert on["temperature_c"] > off["temperature_c"]
    assert off["utilization_percent"] == 0.0

    for t in threads:
        t.join(120)
    beat(agent)  # closes the window that still held the end of the load
    time.sleep(0.3)
    on, _ = beat(agent)
    assert (on["utilization_percent"], on["memory_used_bytes"]) == (0.0, WEIGHTS)
    assert engine_usage(url)["busy_seconds_total"] > 0


@pytest.mark.process
def test_a_card_whose_engine_is_not_a_simulator_reports_idle_and_says_why(
    agent: Agent, executor: CommandExecutor, web_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    card0 = agent.inventory["accelerators"][0]["uuid"]
    start(executor, http_engine_spec(web_root, accelerators=[{"uuid": card0, "simulated": True}]))
    assert len(agent.engines_on_simulated_cards()) == 1
    with caplog.at_level(logging.DEBUG, logger="syshax.agent"):
        on, _ = beat(agent)
        beat(agent)
    assert on["utilization_percent"] == 0.0 and on["memory_used_bytes"] < GIB
    said = [r.getMessage() for r in caplog.records if "not a syshax simulator" in r.getMessage()]
    assert len(said) == 1 and "HTTP 404" in said[0]  # once per engine, not every beat


def test_an_engine_that_does_not_answer_never_holds_up_the_heartbeat() -> None:
    # A listening socket that never accepts: the connection opens, no answer ever comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        engines = [EngineOnCards(f"e{i}", url, (f"SIM-{i}",)) for i in range(6)]
        reader = SimulatedLoadReader(timeout=0.3, budget=1.0)
        began = time.monotonic()
        assert reader.read(engines) == {}
        # Bounded by the beat's budget plus one timeout, not six timeouts.
        assert time.monotonic() - began < 1.0 + 0.3 + 0.5
        reader.close()
    gone = SimulatedLoadReader(timeout=0.3)
    assert gone.read([EngineOnCards("e", f"http://127.0.0.1:{free_port()}", ("X",))]) == {}
    assert gone.read([EngineOnCards("e", None, ("X",))]) == {}
    gone.close()


# ---------------------------------------------------------------- the agent process


@pytest.fixture
def plane() -> Iterator[StandInControlPlane]:
    cp = StandInControlPlane(node_name=f"t-{uuid.uuid4().hex[:8]}")
    cp.start()
    yield cp
    cp.stop()


@pytest.mark.process
def test_the_agent_process_beats_its_simulator_engines_figures(
    plane: StandInControlPlane, tmp_path: Path
) -> None:
    agent = AgentProcess(plane, tmp_path / "state", tmp_path / "agent.log")
    agent.start()
    try:
        (inventory,) = wait_for(lambda: plane.seen("PUT", "nodes/5/inventory"), what="inventory")
        card = inventory["accelerators"][0]["uuid"]
        spec = sim_engine_spec(card)
        dispatch = str(uuid.uuid4())
        plane.enqueue(
            dispatch_id=dispatch,
            action="start",
            deployment_id=3,
            generation=1,
            role="gpu",
            spec=spec,
        )
        (result,) = wait_for(lambda: plane.seen("POST", f"commands/{dispatch}/result"), 60)
        assert result["status"] == "succeeded", result["detail"]

        def last_card() -> dict[str, Any]:
            reading: dict[str, Any] = plane.seen("POST", "nodes/5/heartbeat")[-1]["accelerators"][0]
            return reading

        # The engine's weights appear in the heartbeats, then its load while it works.
        wait_for(lambda: last_card()["memory_used_bytes"] == WEIGHTS, what="the engine's memory")
        url = f"http://127.0.0.1:{spec['port']}"
        load(url, requests=6, words=1000, max_tokens=1500)
        busy = wait_for(
            lambda: (c := last_card())["utilization_percent"] > 20 and c, what="a busy card"
        )
        assert busy["simulated"] and busy["memory_used_bytes"] > WEIGHTS
        assert agent.terminate() == 0
    finally:
        if agent.proc and agent.proc.poll() is None:
            agent.kill()
        runtime = ProcessRuntime(tmp_path / "state")
        for engine in runtime.list({}):
            runtime.stop(engine.engine_id, timeout=3)
