"""An agent runs only what its own configuration allows, whatever a command's spec asks for."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_agent_cli import parse

from agents.cli import build_config
from agents.commands import CommandExecutor
from agents.main import Agent
from agents.runtimes.process import ProcessRuntime
from syshax.common.engine_spec import EngineSpec, SpecError, SpecPolicy


def spec(**fields: object) -> EngineSpec:
    return EngineSpec.from_dict({"command": ["/usr/bin/python3", "-m", "x"], **fields})


def test_a_spec_mounts_only_the_agents_own_mount_paths() -> None:
    policy = SpecPolicy(mount_sources=("/models",))
    policy.check(spec(mounts=[{"source": "/models", "target": "/m"}]))
    with pytest.raises(SpecError, match=r"spec.mounts: host path '/' is not one of .*\(/models\)"):
        policy.check(spec(mounts=[{"source": "/", "target": "/host", "read_only": False}]))
    with pytest.raises(SpecError, match=r"\(none\)"):
        SpecPolicy().check(spec(mounts=[{"source": "/etc", "target": "/etc"}]))


def test_images_and_programs_can_be_pinned_to_patterns() -> None:
    policy = SpecPolicy(allow_images=("registry.local/vllm/*",), allow_commands=("/opt/*/python",))
    policy.check(spec(image="registry.local/vllm/cpu:0.32"))
    with pytest.raises(SpecError, match=r"spec.image: 'evil/miner' matches none"):
        policy.check(spec(image="evil/miner"))
    policy.check(spec(command=["/opt/vllm/python", "-m", "vllm"]))
    with pytest.raises(SpecError, match=r"spec.command: '/bin/sh' matches none"):
        policy.check(spec(command=["/bin/sh", "-c", "id"]))
    SpecPolicy().check(spec(image="anything", command=["/bin/sh"]))  # unpinned: the profile's


def test_a_refused_spec_fails_the_command_and_starts_nothing(tmp_path: Path) -> None:
    runtime = ProcessRuntime(tmp_path / "state")
    executor = CommandExecutor(
        runtime,
        node="n",
        state_dir=tmp_path / "state",
        policy=SpecPolicy(allow_commands=("/opt/vllm/bin/*",)),
    )
    result = executor.execute(
        dispatch_id="d1",
        action="start",
        deployment_id=1,
        generation=1,
        role="gpu",
        spec={"command": ["/bin/sh", "-c", "touch /tmp/pwned"], "port": 1},
    )
    assert result["status"] == "failed"
    assert result["detail"].startswith("spec.command: '/bin/sh' matches none")
    assert runtime.list({}) == []


def test_the_agents_flags_become_its_policy(tmp_path: Path) -> None:
    config = build_config(
        parse(
            "--control-plane",
            "http://cp",
            "--token",
            "sxa_x",
            "--state-dir",
            str(tmp_path),
            "--mount",
            "/models:/m",
            "--allow-image",
            "reg/*",
            "--allow-command",
            "/opt/*",
        )
    )
    policy = Agent(config).spec_policy()
    assert policy == SpecPolicy(("/models",), ("reg/*",), ("/opt/*",))
