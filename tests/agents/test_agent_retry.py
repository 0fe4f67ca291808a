"""``Agent.retry``, how the agent waits on the control plane at start-up: the waits it takes
for each failure, the refusals it gives up on, and the stop that ends a wait."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agents.client import ControlPlaneError, Unreachable
from agents.main import Agent, AgentConfig

CAP = 7.0


class RecordedStop:
    """Stands for the agent's stop event: records each wait and never ends one early."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        return False


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    config = AgentConfig(
        control_plane="http://127.0.0.1:9", token="sxa_test", state_dir=tmp_path, backoff_cap=CAP
    )
    return Agent(config)


@pytest.fixture
def backoffs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``backoff_delay`` made plain: attempt n waits 0.5·(n+1) s; the attempts it was asked
    for are recorded (its jitter is pinned in test_agent_loop.py)."""
    asked: list[int] = []

    def backoff_delay(attempt: int, *, cap: float) -> float:
        assert cap == CAP
        asked.append(attempt)
        return 0.5 * (attempt + 1)

    monkeypatch.setattr("agents.main.backoff_delay", backoff_delay)
    return asked


def answers(*steps: Exception | str) -> Callable[[], str]:
    """A call that raises or returns each step in turn."""
    left: Iterator[Exception | str] = iter(steps)

    def call() -> str:
        step = next(left)
        if isinstance(step, Exception):
            raise step
        return step

    return call


def test_outages_back_off_and_refused_tokens_wait_the_cap_until_it_answers(
    agent: Agent, backoffs: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    stop = RecordedStop()
    agent.stop_event = stop  # type: ignore[assignment]
    fn = answers(
        Unreachable("down"),
        ControlPlaneError(401, "not_authenticated", "no such token"),
        Unreachable("down"),
        ControlPlaneError(403, "permission_denied", "revoked"),
        Unreachable("down"),
        "answered",
    )
    with caplog.at_level(logging.WARNING, logger="syshax.agent"):
        assert agent.retry(fn, "agent/self") == "answered"
    # The back-off grows with the outages only; a refusal waits the cap and leaves it be.
    assert backoffs == [0, 1, 2]
    assert stop.waits == [0.5, CAP, 1.0, CAP, 1.5]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "agent/self: control plane unreachable (down); retry in 0.5s"),
        ("ERROR", "agent/self: HTTP 401 not_authenticated: no such token"),
        ("WARNING", "agent/self: control plane unreachable (down); retry in 1.0s"),
        ("ERROR", "agent/self: HTTP 403 permission_denied: revoked"),
        ("WARNING", "agent/self: control plane unreachable (down); retry in 1.5s"),
    ]


@pytest.mark.parametrize(
    "refusal", [ControlPlaneError(404, "not_found", "no such node"), ValueError("a bug")]
)
def test_any_other_failure_is_raised_at_once(
    agent: Agent, backoffs: list[int], refusal: Exception
) -> None:
    stop = RecordedStop()
    agent.stop_event = stop  # type: ignore[assignment]
    fn = answers(Unreachable("down"), refusal, "never asked")
    with pytest.raises(type(refusal)) as raised:
        agent.retry(fn, "inventory")
    assert raised.value is refusal
    assert stop.waits == [0.5]


@pytest.mark.parametrize(
    "failure", [Unreachable("down"), ControlPlaneError(401, "not_authenticated", "no token")]
)
def test_stopping_during_a_wait_raises_the_failure_it_followed_at_once(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    monkeypatch.setattr("agents.main.backoff_delay", lambda attempt, *, cap: 60.0)
    agent.config.backoff_cap = 60.0
    calls: list[float] = []

    def fn() -> str:
        calls.append(time.monotonic())
        raise failure

    stopper = threading.Timer(0.2, agent.stop_event.set)
    stopper.start()
    try:
        with pytest.raises(type(failure)) as raised:
            agent.retry(fn, "reconcile")
    finally:
        stopper.cancel()
    assert raised.value is failure
    assert len(calls) == 1, "a stopping agent asks the control plane nothing more"
    assert time.monotonic() - calls[0] < 10, "the 60 s wait ended with the stop"


def test_an_agent_already_stopping_raises_after_the_first_failure(agent: Agent) -> None:
    agent.stop_event.set()
    failure = Unreachable("down")
    with pytest.raises(Unreachable) as raised:
        agent.retry(answers(failure, "never asked"), "agent/self")
    assert raised.value is failure
