"""Fixtures of the agent tests: free ports, a tiny HTTP engine, runtimes on temp state dirs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import PROJECT

from agents.commands import CommandExecutor
from agents.engine_policy import EnginePolicy
from agents.runtimes.dockerapi import DockerRuntime
from agents.runtimes.process import ProcessRuntime
from tests.support.podman import podman_service as run_podman_service


@pytest.fixture
def web_root(tmp_path: Path) -> Path:
    """A directory that makes ``python -m http.server`` answer /health and /v1/models with 200."""
    root = tmp_path / "www"
    (root / "v1").mkdir(parents=True)
    (root / "health").write_text("ok")
    (root / "v1/models").write_text('{"data": [{"id": "m"}]}')
    return root


@pytest.fixture
def process_runtime(tmp_path: Path) -> Iterator[ProcessRuntime]:
    runtime = ProcessRuntime(tmp_path / "state")
    yield runtime
    for engine in runtime.list({}):  # never leave an engine behind
        runtime.stop(engine.engine_id, timeout=3)


# The runtime tests' engines are stand-ins (python -m http.server, python -c ...), which only a
# widened policy runs; test_agent_spec_policy.py pins what the default policy refuses.
ANY_ENGINE = EnginePolicy(allow_any_engine=True)


@pytest.fixture
def executor(process_runtime: ProcessRuntime, tmp_path: Path) -> CommandExecutor:
    return CommandExecutor(
        process_runtime, node="node-a", state_dir=tmp_path / "state", policy=ANY_ENGINE
    )


@pytest.fixture(scope="session")
def podman_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real Docker-API engine: Podman's compat service on a private socket, for this session.

    scripts/dev/podman_setup.sh installs Podman from Debian packages the first time (idempotent,
    fast afterwards) and builds the tiny image; this fixture starts and stops its own service.
    """
    setup = subprocess.run(
        [str(PROJECT / "scripts/dev/podman_setup.sh")], capture_output=True, text=True, timeout=900
    )
    assert setup.returncode == 0, f"podman setup failed:\n{setup.stdout}\n{setup.stderr}"
    env_vars = dict(line.split("=", 1) for line in setup.stdout.splitlines() if "=" in line)
    sock_dir = tmp_path_factory.mktemp("podman")
    with run_podman_service(env_vars, sock_dir) as sock:
        yield {**env_vars, "DOCKER_HOST": f"unix://{sock}", "SERVICE_LOG": str(sock_dir)}


@pytest.fixture
def docker_runtime(podman_service: dict[str, str]) -> Iterator[DockerRuntime]:
    runtime = DockerRuntime(podman_service["DOCKER_HOST"])
    yield runtime
    # CPU engines first: a GPU engine cannot go while another container uses its IPC namespace.
    for engine in sorted(runtime.list({"syshax.node": "node-a"}), key=lambda e: e.role != "cpu"):
        runtime.stop(engine.engine_id, timeout=2)
    runtime.client.close()
