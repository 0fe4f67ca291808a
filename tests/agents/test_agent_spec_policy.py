"""An agent runs only what its own configuration allows, whatever a command's spec asks for.

Whoever may edit a profile writes the spec every node's agent runs. Each test here is one way
such a spec used to run code of its choosing on a node, refused now by the agent's default
policy with one line naming the field and the rule.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import free_port, sim_spec
from test_agent_cli import parse

from agents.cli import build_config
from agents.commands import CommandExecutor
from agents.engine_policy import EnginePolicy
from agents.main import Agent
from agents.runtimes.process import ProcessRuntime
from common.engine_spec import EngineSpec, Mount, SpecError, kv_connector_dir

BIN = os.path.dirname(os.path.abspath(sys.executable))  # the agent's interpreter's directory
SIM = [sys.executable, "-m", "syshax.cli", "sim"]


def start(executor: CommandExecutor, spec: dict[str, Any], deployment_id: int = 1) -> Any:
    return executor.execute(
        dispatch_id=f"d-{free_port()}",
        action="start",
        deployment_id=deployment_id,
        generation=1,
        role="gpu",
        spec=spec,
    )


@pytest.fixture
def default_executor(tmp_path: Path) -> CommandExecutor:
    """An executor with no policy given: the agent's default one."""
    return CommandExecutor(ProcessRuntime(tmp_path / "state"), node="n", state_dir=tmp_path / "s")


def accepts(policy: EnginePolicy, runtime: str = "process", **fields: Any) -> EngineSpec:
    return policy.check(EngineSpec.from_dict(fields), runtime)


def refused(policy: EnginePolicy, runtime: str = "process", **fields: Any) -> str:
    with pytest.raises(SpecError) as caught:
        policy.check(EngineSpec.from_dict(fields), runtime)
    return str(caught.value)


DEFAULT = EnginePolicy(search_path=BIN)


def evil_program(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """An executable called ``name`` outside every allowed place; it leaves a marker if run."""
    marker = tmp_path / "pwned"
    program = tmp_path / "evil" / name
    program.parent.mkdir(exist_ok=True)
    program.write_text(f"#!/bin/sh\ntouch {marker}\n")
    program.chmod(0o755)
    return program, marker


def test_a_program_named_like_an_engine_elsewhere_is_refused_and_never_runs(
    default_executor: CommandExecutor, tmp_path: Path
) -> None:
    # `--allow-command '*/vllm'` used to let /tmp/evil/vllm through: the basename matched.
    entries = {"vllm": ["serve"], "syshax": ["sim"], "python3": ["-m", "syshax.cli", "sim"]}
    for name, entry in entries.items():
        program, marker = evil_program(tmp_path, name)
        result = start(default_executor, {"command": [str(program), *entry], "port": 1})
        assert result["status"] == "failed"
        assert result["detail"].startswith(f"spec.command: '{program} {' '.join(entry[:2])}'")
        assert "widen with --engine-python or --allow-command" in result["detail"]
        assert not marker.exists()
    # An image on the process runtime no longer skips the program's check.
    shell = {"image": "vllm/vllm-openai:latest", "command": ["/bin/sh", "-c", f"touch {marker}"]}
    assert start(default_executor, shell | {"port": 1})["detail"].startswith("spec.command:")
    assert not marker.exists()
    assert default_executor.runtime.list({}) == []


def test_programs_are_matched_as_absolute_paths_and_allow_command_by_segments(
    tmp_path: Path,
) -> None:
    assert DEFAULT.check(
        EngineSpec.from_dict({"command": ["syshax", "sim"]}), "process"
    ).command == (f"{BIN}/syshax", "sim")  # executed as the absolute path checked
    assert "must be an absolute path or a bare name" in refused(DEFAULT, command=["bin/syshax"])
    assert "is not on the agent's PATH" in refused(DEFAULT, command=["no-such-engine"])
    assert "is not an engine entry point" in refused(DEFAULT, command=[*SIM[:1], "-c", "1"])
    assert "is not an engine entry point" in refused(DEFAULT, command=[SIM[0], "-m", "http.server"])
    pinned = EnginePolicy(allow_commands=("/opt/vllm-*/bin/vllm-launcher",), search_path=BIN)
    pinned.check(EngineSpec.from_dict({"command": ["/opt/vllm-0.32/bin/vllm-launcher"]}), "process")
    assert "is not an engine entry point" in refused(
        pinned, command=["/opt/vllm-0.32/evil/bin/vllm-launcher"]
    )
    with pytest.raises(SystemExit, match=r"--allow-command '\*/vllm': give an absolute path"):
        Agent(config(tmp_path, "--allow-command", "*/vllm"))


def test_engine_env_passes_only_engine_settings(tmp_path: Path) -> None:
    for name, value in (
        ("LD_PRELOAD", "/tmp/evil.so"),
        ("LD_LIBRARY_PATH", "/tmp/evil"),
        ("PYTHONSTARTUP", "/tmp/evil.py"),
        ("PYTHONWARNINGS", "ignore::evil.Warning"),
        ("PATH", "/tmp/evil"),
        ("HOME", "/tmp/evil"),
    ):
        assert refused(DEFAULT, command=SIM, env={name: value}).startswith(
            f"spec.env: {name} is not an engine setting this agent passes"
        )
    assert "a logging config file" in refused(
        DEFAULT, command=SIM, env={"VLLM_LOGGING_CONFIG_PATH": "/m/log.json"}
    )
    assert "library or plugin" in refused(DEFAULT, command=SIM, env={"NCCL_NET_PLUGIN": "x"})
    assert "control characters" in refused(DEFAULT, command=SIM, env={"OMP_NUM_THREADS": "1\n"})
    engine_env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "0-3",
        "CUSTOM_CPU_AFFINITY": "0-3",
        "OMP_NUM_THREADS": "4",
        "HF_HUB_OFFLINE": "1",
        "HF_TOKEN": "hf_x",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SYSHAX_QUANTIZE": "q4_0",
        "PYTHONPATH": str(kv_connector_dir()),
    }
    DEFAULT.check(EngineSpec.from_dict({"command": SIM, "env": engine_env}), "process")
    widened = EnginePolicy(allow_env=("LD_LIBRARY_PATH", "MY_*"), search_path=BIN)
    widened.check(
        EngineSpec.from_dict({"command": SIM, "env": {"LD_LIBRARY_PATH": "/x", "MY_A": "1"}}),
        "process",
    )


def test_pythonpath_may_name_only_the_kv_connector(
    default_executor: CommandExecutor, tmp_path: Path
) -> None:
    # A `vllm` package of the spec's choosing, first on the engine's path.
    evil = tmp_path / "evil"
    (evil / "syshax").mkdir(parents=True)
    result = start(default_executor, sim_spec(env={"PYTHONPATH": f"{kv_connector_dir()}:{evil}"}))
    assert result["status"] == "failed"
    assert result["detail"] == (
        f"spec.env: PYTHONPATH may name only the KV connector directory ({kv_connector_dir()}), "
        f"not '{evil}'"
    )
    docker = EnginePolicy(allow_images=("img",))
    assert "/opt/syshax/kvconnector" in refused(
        docker, "docker", image="img", command=["syshax", "sim"], env={"PYTHONPATH": "/m"}
    )
    assert default_executor.runtime.list({}) == []


def test_a_working_directory_outside_the_agents_roots_is_refused(
    default_executor: CommandExecutor, tmp_path: Path
) -> None:
    # `python -m` imports from its working directory first: a directory of the spec's choosing
    # with a syshax package in it would run instead of the agent's.
    evil = tmp_path / "evil"
    (evil / "syshax").mkdir(parents=True)
    result = start(default_executor, sim_spec(working_dir=str(evil)))
    assert result["status"] == "failed"
    assert result["detail"].startswith(
        f"spec.working_dir: '{evil}' is outside this agent's engine directories"
    )
    roots = EnginePolicy(workdir_roots=(str(tmp_path / "engines"),), search_path=BIN)
    (tmp_path / "engines" / "a").mkdir(parents=True)
    accepts(roots, command=SIM, working_dir=str(tmp_path / "engines/a"))
    (tmp_path / "engines" / "link").symlink_to(evil)  # inside by name, outside in fact
    assert "outside" in refused(roots, command=SIM, working_dir=str(tmp_path / "engines/link"))
    assert "outside" in refused(roots, command=SIM, working_dir=str(tmp_path / "engines/../evil"))
    assert default_executor.runtime.list({}) == []


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--worker-extension-cls", "evil.Ext"], "--worker-extension-cls loads a class"),
        (["--worker_extension_cls=evil.Ext"], "--worker-extension-cls loads a class"),
        (["--worker-ext", "evil.Ext"], "--worker-ext abbreviates --worker-extension-cls"),
        (["--trust-remote-code"], "--trust-remote-code runs Python code that ships with"),
        (["--tool-parser-plugin", "/m/p.py"], "--tool-parser-plugin runs a Python file"),
        (["--config", "/m/more-args.yaml"], "--config reads further engine arguments"),
        (
            ["--kv-transfer-config", '{"kv_connector": "X", "kv_connector_module_path": "evil"}'],
            "--kv-transfer-config kv_connector_module_path 'evil' is not the syshax connector",
        ),
        (
            ["--kv-transfer-config.kv_connector_module_path", "evil"],
            "sets kv_connector_module_path",
        ),
        (["--kv-transfer", '{"kv_connector": "X"}'], "abbreviates --kv-transfer-config"),
        (["-O", '{"backend": "evil.compile"}'], "backend 'evil.compile' loads a function"),
        (['-O{"backend": "evil.compile"}'], "backend 'evil.compile' loads a function"),
        (["--compilation-config.cache_dir", "/m/c"], "cache_dir makes vLLM load compiled"),
        (["--distributed-executor-backend", "evil.Executor"], "'evil.Executor' is not one of"),
        (["--speculative-config", '{"draft": {"proposer_cls": "e.P"}}'], "proposer_cls"),
    ],
)
def test_arguments_that_load_code_are_refused(args: list[str], reason: str) -> None:
    detail = refused(DEFAULT, command=SIM, args=["--device", "a100-80gb", *args])
    assert detail.startswith("spec.args: ") and reason in detail, detail


def test_the_syshax_connector_and_lifted_flags_pass() -> None:
    from common.engine_spec import kv_transfer_config

    config = kv_transfer_config("syshax-1-g1-gpu", "syshax-1-g1-cpu", arena_mib=64)
    args = ["--kv-transfer-config", config, "--enable-prompt-tokens-details", "-O3", "-tp", "2"]
    DEFAULT.check(EngineSpec.from_dict({"command": SIM, "args": args}), "process")
    lifted = EnginePolicy(allow_engine_args=("--trust-remote-code",), search_path=BIN)
    lifted.check(EngineSpec.from_dict({"command": SIM, "args": ["--trust-remote-code"]}), "process")
    assert "widen with --allow-engine-arg trust-remote-code" in refused(
        DEFAULT, command=SIM, args=["--trust-remote-code"]
    )


def test_images_are_the_engine_images_unless_widened() -> None:
    docker = EnginePolicy()
    for image in (
        "vllm/vllm-openai:v0.32.0",
        "docker.io/vllm/vllm-cpu@sha256:" + "0" * 64,
        "syshax-controlplane:latest",
        "localhost/syshax-controlplane:latest",
    ):
        accepts(docker, "docker", image=image, args=["--model", "m"])
    for image in ("evil/miner", "vllm/vllm-openai-evil:1", "evil.io/vllm/vllm-openai:1"):
        assert refused(docker, "docker", image=image, args=["x"]).startswith(
            f"spec.image: '{image}' is not an engine image this agent runs"
        )
    widened = EnginePolicy(allow_images=("registry.local/vllm/*",))
    accepts(widened, "docker", image="registry.local/vllm/cpu:1", args=["x"])
    # Inside an allowed image only the engine entry points run, from the image's own places.
    image = {"image": "vllm/vllm-openai:latest"}
    accepts(
        docker, "docker", **image, command=["python3", "-m", "vllm.entrypoints.openai.api_server"]
    )
    assert "is not an engine entry point" in refused(docker, "docker", **image, command=["sh"])
    assert "is not an engine entry point" in refused(
        docker, "docker", **image, command=["/models/bin/vllm", "serve"]
    )


def test_a_read_only_mount_stays_read_only_and_where_the_agent_put_it() -> None:
    policy = EnginePolicy(mounts=(Mount("/models", "/models"),), allow_any_engine=True)
    accepts(policy, "docker", command=SIM, mounts=[{"source": "/models", "target": "/models"}])
    writable = {"source": "/models", "target": "/models", "read_only": False}
    assert refused(policy, "docker", command=SIM, mounts=[writable]) == (
        "spec.mounts: host path '/models' is read-only on this agent "
        "(--mount /models:/models:ro); a spec cannot make it writable"
    )
    # Mounted over the engine's own code, the model cache would be imported.
    elsewhere = {"source": "/models", "target": "/usr/lib/python3/dist-packages"}
    assert "is mounted at '/models' by this agent" in refused(
        policy, "docker", command=SIM, mounts=[elsewhere]
    )
    assert "is not one of this agent's --mount paths (/models)" in refused(
        policy, "docker", command=SIM, mounts=[{"source": "/", "target": "/host"}]
    )


def test_the_docker_runtime_keeps_the_agents_read_only_mounts_read_only() -> None:
    """Whatever a spec says (here: no policy at all), the runtime mounts an agent's ``:ro``
    path read-only."""
    from agents.runtimes.dockerapi import DockerRuntime

    created: dict[str, Any] = {}

    class Created(Exception):
        """Raised instead of creating the container: its arguments are what is checked."""

    class Containers:
        def run(self, **kwargs: Any) -> Any:
            created.update(kwargs)
            raise Created

    runtime = DockerRuntime.__new__(DockerRuntime)
    runtime.default_mounts = (Mount("/models", "/models", read_only=True),)
    runtime.client = type("Client", (), {"containers": Containers()})()
    spec = EngineSpec.from_dict(
        {
            "image": "i",
            "command": ["x"],
            "mounts": [{"source": "/models", "target": "/models", "read_only": False}],
        }
    )
    with pytest.raises(Created):
        runtime.start("n", spec, {}, None)
    (mount,) = created["mounts"]
    assert mount["Target"] == "/models" and mount["ReadOnly"] is True


def config(tmp_path: Path, *flags: str) -> Any:
    return build_config(
        parse(
            "--control-plane", "http://cp", "--token", "sxa_x", "--state-dir", str(tmp_path), *flags
        )
    )


def test_the_agents_flags_become_its_policy_and_each_widening_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flags = [
        *("--mount", "/models:/m", "--engine-python", "/opt/vllm/bin/python"),
        *("--allow-image", "reg/*", "--allow-command", "/opt/x/bin/engine"),
        *("--allow-env", "LD_LIBRARY_PATH", "--allow-engine-arg", "trust-remote-code"),
        *("--allow-workdir", "/srv/engines", "--allow-any-engine"),
    ]
    with caplog.at_level(logging.WARNING, logger="syshax.agent"):
        policy = Agent(config(tmp_path, *flags)).policy
    assert policy == EnginePolicy(
        mounts=(Mount("/models", "/m", read_only=True),),
        interpreters=(os.path.abspath(sys.executable), "/opt/vllm/bin/python"),
        allow_images=("reg/*",),
        allow_commands=("/opt/x/bin/engine",),
        allow_env=("LD_LIBRARY_PATH",),
        allow_engine_args=("--trust-remote-code",),
        workdir_roots=(str(tmp_path), "/srv/engines"),
        allow_any_engine=True,
    )
    widened = [r.getMessage() for r in caplog.records]
    assert "engine policy widened by --allow-image reg/*" in widened
    assert "engine policy widened by --allow-engine-arg --trust-remote-code" in widened
    assert any("--allow-any-engine" in line for line in widened)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="syshax.agent"):
        default = Agent(config(tmp_path)).policy
    assert caplog.records == [] and default.widenings() == []
    with pytest.raises(SystemExit, match="--pass-env SYSHAX_AGENT_TOKEN"):
        Agent(config(tmp_path, "--pass-env", "SYSHAX_AGENT_TOKEN"))
    file = tmp_path / "agent.json"
    file.write_text(json.dumps({"allow_any_engine": True, "engine_python": ["/opt/p/python"]}))
    from_file = Agent(config(tmp_path, "--config", str(file))).policy
    assert from_file.allow_any_engine and from_file.interpreters[-1] == "/opt/p/python"
