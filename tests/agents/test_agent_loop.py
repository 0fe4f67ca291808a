"""The agent process: HTTP client back-off, heartbeats, outage and reconcile, fetched commands.

The control plane here is the stand-in of standin_control_plane.py (it records requests and
hands out commands as ``GET agent/commands`` does), so these tests pin the agent's client
behaviour. test_agent_e2e.py runs the agent against the real control plane.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import PROJECT, http_engine_spec
from standin_control_plane import StandInControlPlane

from agents.client import (
    ControlPlaneClient,
    ControlPlaneError,
    Unreachable,
    backoff_delay,
    jittered,
)
from agents.commands import probe
from common.supervisor import wait_until


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    return wait_until(pred, timeout, what, interval=0.05)


def test_backoff_grows_exponentially_with_full_jitter_up_to_the_cap() -> None:
    rng = random.Random(7)
    samples = [[backoff_delay(a, base=0.5, cap=8.0, rng=rng) for _ in range(200)] for a in range(8)]
    for attempt, values in enumerate(samples):
        ceiling = min(8.0, 0.5 * 2**attempt)
        assert all(0 <= v <= ceiling for v in values)
        assert max(values) > 0.8 * ceiling  # jitter spans the whole window ...
        assert len({round(v, 6) for v in values}) > 150  # ... and never repeats in lockstep
    assert max(samples[7]) <= 8.0


def test_heartbeats_answered_together_drift_apart() -> None:
    """300 agents whose beats were answered in one group commit: waiting a jittered
    interval, within a few intervals their beats no longer come together."""
    rng = random.Random(11)
    waits = [jittered(10.0, rng=rng) for _ in range(2000)]
    assert all(9.0 <= w <= 11.0 for w in waits)
    assert abs(sum(waits) / len(waits) - 10.0) < 0.1, "the mean stays the interval"
    due = [0.0] * 300
    for _ in range(5):  # five beats each, every wait from that agent's own last answer
        due = [t + jittered(10.0, rng=rng) for t in due]
    busiest = max(sum(1 for t in due if s <= t < s + 0.1) for s in due)
    assert busiest < 30, f"{busiest} of 300 still beat within 100 ms of each other"


def test_client_tells_unreachable_from_refused(tmp_path: Path) -> None:
    plane = StandInControlPlane(node_name="n")
    plane.start()
    try:
        assert ControlPlaneClient(plane.url, "sxa_test").agent_self()["node"]["id"] == 5
        with pytest.raises(ControlPlaneError) as refused:
            ControlPlaneClient(plane.url, "sxa_wrong").agent_self()
        assert refused.value.status == 401 and refused.value.code == "not_authenticated"
    finally:
        plane.stop()
    with pytest.raises(Unreachable, match="ConnectError"):
        ControlPlaneClient(plane.url, "sxa_test", timeout=1).agent_self()


@pytest.fixture
def node_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def plane(node_name: str) -> Iterator[StandInControlPlane]:
    cp = StandInControlPlane(node_name=node_name)
    cp.start()
    yield cp
    cp.stop()


class AgentProcess:
    def __init__(self, plane: StandInControlPlane, state_dir: Path, log: Path, *extra: str) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "syshax.cli",
            "agent",
            "--control-plane",
            plane.url,
            "--token",
            "sxa_test",
            "--runtime",
            "process",
            "--state-dir",
            str(state_dir),
            "--heartbeat-interval",
            "0.2",
            "--simulate-accelerator",
            "a100-80gb",
            *extra,
        ]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT
            )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(timeout=20)


@pytest.mark.process
def test_agent_beats_takes_commands_survives_an_outage_and_readopts_after_a_kill(
    plane: StandInControlPlane, node_name: str, tmp_path: Path, web_root: Path
) -> None:
    # Its engine is a stand-in (python -m http.server), which only a widened policy runs.
    agent = AgentProcess(plane, tmp_path / "state", tmp_path / "agent.log", "--allow-any-engine")
    agent.start()
    try:
        (inventory,) = wait_for(lambda: plane.seen("PUT", "nodes/5/inventory"), what="inventory")
        (sim,) = inventory["accelerators"]
        assert sim["simulated"] and sim["model"] == "A100-SXM4-80GB"
        wait_for(lambda: len(plane.seen("POST", "nodes/5/heartbeat")) >= 3, what="heartbeats")
        assert plane.seen("PUT", "nodes/5/containers")[0] == {"containers": []}

        # A heartbeat answered with another hash makes the agent send its inventory again.
        plane.force_hash_mismatch = 1
        wait_for(lambda: len(plane.seen("PUT", "nodes/5/inventory")) == 2, what="resend")

        # A start command fetched from the control plane; its result goes back over REST.
        spec = http_engine_spec(web_root, accelerators=[{"uuid": sim["uuid"], "simulated": True}])
        endpoint = f"http://127.0.0.1:{spec['port']}"
        start = {
            "dispatch_id": str(uuid.uuid4()),
            "action": "start",
            "deployment_id": 3,
            "generation": 1,
            "role": "gpu",
            "spec": spec,
        }
        plane.enqueue(**start)
        path = f"commands/{start['dispatch_id']}/result"
        (result,) = wait_for(lambda: plane.seen("POST", path), what="start result")
        assert result["status"] == "succeeded", result["detail"]
        engine_id = result["containers"][0]["engine_id"]
        # The card's engine is not a simulator (no /sim/info): the card honestly reports idle
        # rather than invented load (test_agent_simulated_load.py has a real simulator).
        beats_now = len(plane.seen("POST", "nodes/5/heartbeat"))
        wait_for(
            lambda: len(plane.seen("POST", "nodes/5/heartbeat")) > beats_now + 2,
            what="heartbeats with the engine running",
        )
        card = plane.seen("POST", "nodes/5/heartbeat")[-1]["accelerators"][0]
        assert card["simulated"] and card["utilization_percent"] == 0.0

        # A command whose result cannot be delivered: the result waits in the outbox ...
        plane.fail_results = True
        inspect = {
            "dispatch_id": str(uuid.uuid4()),
            "action": "inspect",
            "deployment_id": 3,
            "generation": 1,
            "role": "gpu",
            "spec": {},
        }
        plane.enqueue(**inspect)
        outbox = tmp_path / "state" / "outbox"
        wait_for(lambda: list(outbox.glob("*.json")), what="the result in the outbox")
        # ... through an outage: the control plane goes away; the engine keeps serving; the
        # agent backs off.
        plane.stop()
        plane.fail_results = False
        time.sleep(1.0)
        assert probe(endpoint, "/health")[0]
        beats_before = len(plane.seen("POST", "nodes/5/heartbeat"))
        containers_before = len(plane.seen("PUT", "nodes/5/containers"))
        plane.start()  # same port
        wait_for(
            lambda: len(plane.seen("PUT", "nodes/5/containers")) > containers_before,
            what="reconcile after the outage",
        )
        last = plane.seen("PUT", "nodes/5/containers")[-1]["containers"]
        assert [(c["engine_id"], c["health"]) for c in last] == [(engine_id, "healthy")]
        (inspected,) = wait_for(
            lambda: plane.seen("POST", f"commands/{inspect['dispatch_id']}/result"),
            what="the outbox delivered",
        )
        assert inspected["containers"][0]["engine_id"] == engine_id
        assert not list(outbox.glob("*.json"))
        wait_for(
            lambda: len(plane.seen("POST", "nodes/5/heartbeat")) > beats_before + 2,
            what="heartbeats resume",
        )

        # Kill -9 the agent; a new one re-adopts the engine, and a redelivered start is harmless.
        agent.kill()
        assert probe(endpoint, "/health")[0]
        containers_before = len(plane.seen("PUT", "nodes/5/containers"))
        agent.start()
        wait_for(
            lambda: len(plane.seen("PUT", "nodes/5/containers")) > containers_before,
            what="reconcile after restart",
        )
        adopted = plane.seen("PUT", "nodes/5/containers")[-1]["containers"]
        assert [c["engine_id"] for c in adopted] == [engine_id]
        plane.enqueue(**start)  # redelivery of the same dispatch
        wait_for(lambda: len(plane.seen("POST", path)) == 2, what="repeated result")
        assert plane.seen("POST", path)[1] == result
        again = dict(start, dispatch_id=str(uuid.uuid4()))  # same generation, new dispatch
        plane.enqueue(**again)
        (second,) = wait_for(
            lambda: plane.seen("POST", f"commands/{again['dispatch_id']}/result"),
            what="second start",
        )
        assert second["output"]["adopted"] is True
        assert second["containers"][0]["engine_id"] == engine_id

        stop = {
            "dispatch_id": str(uuid.uuid4()),
            "action": "stop",
            "deployment_id": 3,
            "generation": 1,
            "role": None,
            "spec": {},
        }
        plane.enqueue(**stop)
        (stopped,) = wait_for(
            lambda: plane.seen("POST", f"commands/{stop['dispatch_id']}/result"), what="stop result"
        )
        assert stopped["output"]["stopped"] == [result["containers"][0]["name"]]
        assert not probe(endpoint, "/health")[0]
        assert agent.terminate() == 0
    finally:
        if agent.proc and agent.proc.poll() is None:
            agent.kill()
        from agents.runtimes.process import ProcessRuntime

        runtime = ProcessRuntime(tmp_path / "state")
        for engine in runtime.list({}):
            runtime.stop(engine.engine_id, timeout=3)
