"""An engine's environment is a few of the agent's variables and its spec's, never the agent's
token: a real simulator started by the process runtime, its environment read from /proc."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import psutil
import pytest
from agent_helpers import sim_spec
from test_agent_process_runtime import engine_child_pid

from agents.commands import CommandExecutor
from agents.runtimes.process import ProcessRuntime

pytestmark = pytest.mark.process

AGENT_ONLY = {
    "SYSHAX_AGENT_TOKEN": "sxa_the_agents_secret",
    "SYSHAX_CONTROL_PLANE": "http://cp.example:8000",
    "DATABASE_URL": "postgres://syshax:pw@db/syshax",
    "PYTHONSTARTUP": "/tmp/agent-startup.py",
    "LD_LIBRARY_PATH": "/opt/agent/lib",
}


def start_engine(runtime: ProcessRuntime, tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Start a simulator under the default policy; the environments of its launcher and of
    the engine process itself."""
    executor = CommandExecutor(runtime, node="n", state_dir=tmp_path / "dispatches")
    spec = sim_spec(env={"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"})
    result = executor.execute(
        dispatch_id=str(uuid.uuid4()),
        action="start",
        deployment_id=1,
        generation=1,
        role="gpu",
        spec=spec,
    )
    assert result["status"] == "succeeded", result["detail"]
    (engine,) = runtime.list({})
    launcher = psutil.Process(int(engine.extra["pid"])).environ()
    child = psutil.Process(engine_child_pid(runtime, engine.engine_id)).environ()
    return launcher, child


def test_an_engine_gets_a_minimal_environment_without_the_agents_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in AGENT_ONLY.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LANG", "C.UTF-8")
    runtime = ProcessRuntime(tmp_path / "state")
    try:
        for environ in start_engine(runtime, tmp_path):
            assert not set(AGENT_ONLY) & set(environ), sorted(environ)
            assert not [name for name in environ if name.startswith("SYSHAX_")]
            assert "sxa_the_agents_secret" not in "".join(environ.values())
            assert environ["PATH"] == os.environ["PATH"] and environ["LANG"] == "C.UTF-8"
            assert environ["HOME"] == os.environ["HOME"]
            assert environ["VLLM_CPU_KVCACHE_SPACE"] == "2" and environ["HF_HUB_OFFLINE"] == "1"
    finally:
        for engine in runtime.list({}):
            runtime.stop(engine.engine_id, timeout=3)


def test_pass_env_hands_engines_a_variable_the_operator_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in AGENT_ONLY.items():
        monkeypatch.setenv(name, value)
    runtime = ProcessRuntime(tmp_path / "state", pass_env=["LD_LIBRARY_PATH"])
    try:
        _, child = start_engine(runtime, tmp_path)
        assert child["LD_LIBRARY_PATH"] == "/opt/agent/lib"
        assert "SYSHAX_AGENT_TOKEN" not in child and "DATABASE_URL" not in child
    finally:
        for engine in runtime.list({}):
            runtime.stop(engine.engine_id, timeout=3)
