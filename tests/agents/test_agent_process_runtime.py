"""Command semantics on the process runtime: real processes, real ports, real restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from agent_helpers import http_engine_spec

from agents.commands import CommandExecutor
from agents.runtimes.process import ProcessRuntime
from common.engine_spec import kv_connector_dir

pytestmark = pytest.mark.process


def run(
    executor: CommandExecutor,
    action: str,
    role: str | None = "gpu",
    generation: int = 1,
    spec: dict[str, Any] | None = None,
    dispatch_id: str | None = None,
    deployment_id: int = 7,
) -> dict[str, Any]:
    return executor.execute(
        dispatch_id=dispatch_id or str(uuid.uuid4()),
        action=action,
        deployment_id=deployment_id,
        generation=generation,
        role=role,
        spec=spec,
    )


def engine_child_pid(runtime: ProcessRuntime, engine_id: str) -> int:
    exit_file = runtime.engines_dir / f"{engine_id}.exit"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            pid = json.loads(exit_file.read_text())["child_pid"]
            if pid:
                return int(pid)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError("launcher never reported its engine pid")


def test_start_is_idempotent_by_dispatch_and_by_labels(
    executor: CommandExecutor, process_runtime: ProcessRuntime, web_root: Path
) -> None:
    spec = http_engine_spec(web_root)
    first = run(executor, "start", spec=spec, dispatch_id="d-1")
    assert first["status"] == "succeeded", first["detail"]
    (container,) = first["containers"]
    assert container["health"] == "healthy" and container["status"] == "running"
    assert container["name"] == "syshax-7-g1-gpu"
    assert container["endpoint"] == f"http://127.0.0.1:{spec['port']}"
    assert first["output"]["adopted"] is False

    assert run(executor, "start", spec=spec, dispatch_id="d-1") == first  # redelivery
    again = run(executor, "start", spec=spec, dispatch_id="d-2")  # same generation, new dispatch
    assert again["status"] == "succeeded"
    assert again["output"]["adopted"] is True
    assert again["containers"][0]["engine_id"] == container["engine_id"]
    assert len(process_runtime.list({"syshax.deployment": "7"})) == 1


def test_a_restarted_agent_readopts_its_engine_and_starts_nothing(
    executor: CommandExecutor, web_root: Path, tmp_path: Path
) -> None:
    spec = http_engine_spec(web_root)
    first = run(executor, "start", spec=spec)
    engine_id = first["containers"][0]["engine_id"]
    # A new agent: new runtime and executor objects, same state dir, engine not its child.
    runtime2 = ProcessRuntime(tmp_path / "state")
    executor2 = CommandExecutor(
        runtime2, node="node-a", state_dir=tmp_path / "state", policy=executor.policy
    )
    (state,) = executor2.all_container_states()
    assert state["engine_id"] == engine_id and state["health"] == "healthy"
    second = run(executor2, "start", spec=spec)
    assert second["output"]["adopted"] is True
    assert [e.engine_id for e in runtime2.list({})] == [engine_id]
    assert run(executor2, "stop", role=None, generation=1)["status"] == "succeeded"
    assert runtime2.list({}) == []


def test_an_engine_that_exits_fails_the_start_with_its_code_and_last_log_lines(
    executor: CommandExecutor, process_runtime: ProcessRuntime
) -> None:
    spec = {
        "command": [
            sys.executable,
            "-c",
            "import sys; print('loading model'); print('error: no such model', "
            "flush=True); sys.exit(3)",
        ],
        "port": 1,
        "health_timeout_seconds": 20,
    }
    result = run(executor, "start", role="cpu", spec=spec | {"ipc": "private"})
    assert result["status"] == "failed", result
    # The cause first, then where the whole log is kept, then the log's last lines.
    detail = str(result["detail"])
    assert detail.startswith("CPU engine exited with code 3: error: no such model | full log: ")
    _, where, tail = detail.split(" | ", 2)
    kept = Path(where.removeprefix("full log: ").split(":", 1)[1])
    assert "loading model" in kept.read_text() and tail.startswith("loading model")
    assert process_runtime.list({}) == []  # nothing orphaned


def test_an_engine_never_healthy_times_out_and_is_removed(
    executor: CommandExecutor, process_runtime: ProcessRuntime, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = http_engine_spec(empty, health_timeout_seconds=1.5)
    result = run(executor, "start", spec=spec)
    assert result["status"] == "failed"
    assert "GPU engine not healthy after 1.5 s (/health: HTTP 404" in str(result["detail"])
    assert process_runtime.list({}) == []


def test_cpu_engine_needs_its_gpu_peer_and_stop_takes_both(
    executor: CommandExecutor, process_runtime: ProcessRuntime, web_root: Path
) -> None:
    cpu_spec = http_engine_spec(web_root, cpuset="0", env={"OMP_NUM_THREADS": "1"})
    refused = run(executor, "start", role="cpu", spec=cpu_spec)
    assert refused["status"] == "failed"
    assert "IPC peer GPU engine syshax-7-g1-gpu is not running" in str(refused["detail"])
    assert run(executor, "start", role="gpu", spec=http_engine_spec(web_root))["status"] == (
        "succeeded"
    )
    started = run(executor, "start", role="cpu", spec=cpu_spec)
    assert started["status"] == "succeeded", started["detail"]
    cpu_engine = process_runtime.list({"syshax.role": "cpu"})[0]
    child = psutil.Process(engine_child_pid(process_runtime, cpu_engine.engine_id))
    assert child.cpu_affinity() == [0]  # the cpuset really binds the engine
    assert child.environ()["OMP_NUM_THREADS"] == "1"

    inspected = run(executor, "inspect", role=None, generation=1)
    assert {c["role"] for c in inspected["containers"]} == {"gpu", "cpu"}
    stopped = run(executor, "stop", role=None, generation=1)
    assert [c["role"] for c in stopped["containers"]] == ["cpu", "gpu"]
    assert not child.is_running()
    assert process_runtime.list({}) == []
    assert run(executor, "stop", role=None, generation=1)["detail"] == "stopped 0 engine(s)"


def test_a_kv_connector_engine_finds_the_agents_copy_of_the_connector_first_on_pythonpath(
    executor: CommandExecutor, process_runtime: ProcessRuntime, web_root: Path
) -> None:
    spec = http_engine_spec(web_root, kv_connector=True, env={"PYTHONPATH": "/models/lib"})
    started = run(executor, "start", spec=spec)
    assert started["status"] == "succeeded", started["detail"]
    engine = process_runtime.list({})[0]
    environ = psutil.Process(engine_child_pid(process_runtime, engine.engine_id)).environ()
    connector = kv_connector_dir()
    assert environ["PYTHONPATH"].split(os.pathsep) == [str(connector), "/models/lib"]
    found = subprocess.run(
        [sys.executable, "-c", FIND_CONNECTOR],
        env={"PYTHONPATH": environ["PYTHONPATH"], "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == str(connector / "syshax_kv_connector.py")

    plain = run(executor, "start", spec=http_engine_spec(web_root), deployment_id=8)
    assert plain["status"] == "succeeded"
    other = process_runtime.list({"syshax.deployment": "8"})[0]
    pythonpath = psutil.Process(engine_child_pid(process_runtime, other.engine_id)).environ()
    assert str(connector) not in pythonpath.get("PYTHONPATH", "")


# What vLLM does with kv_connector_module_path, without importing vLLM (not installed here).
FIND_CONNECTOR = "import importlib.util as u; print(u.find_spec('syshax_kv_connector').origin)"


def test_a_new_generation_replaces_the_old_and_a_stale_one_is_refused(
    executor: CommandExecutor, process_runtime: ProcessRuntime, web_root: Path
) -> None:
    assert run(executor, "start", generation=1, spec=http_engine_spec(web_root))["status"] == (
        "succeeded"
    )
    assert run(executor, "start", generation=2, spec=http_engine_spec(web_root))["status"] == (
        "succeeded"
    )
    assert [e.generation for e in process_runtime.list({})] == [2]
    stale = run(executor, "start", generation=1, spec=http_engine_spec(web_root))
    assert stale["status"] == "failed" and "stale command: generation 2" in str(stale["detail"])


def test_restart_policy_brings_a_killed_engine_back_and_logs_show_it(
    executor: CommandExecutor, process_runtime: ProcessRuntime, web_root: Path
) -> None:
    spec = http_engine_spec(web_root)
    run(executor, "start", spec=spec)
    engine = process_runtime.list({})[0]
    first_pid = engine_child_pid(process_runtime, engine.engine_id)
    os.kill(first_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = process_runtime.inspect(engine.engine_id)
        assert state is not None
        if state.restarts == 1 and engine_child_pid(process_runtime, engine.engine_id) != first_pid:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the launcher did not restart the engine")
    assert state.status == "running"
    logs = run(executor, "logs", role="gpu", spec={"tail": 5})
    assert "syshax-7-g1-gpu" in logs["output"]["logs"]


def test_unknown_spec_keys_are_reported_and_informational_ones_accepted(
    executor: CommandExecutor, web_root: Path
) -> None:
    spec = http_engine_spec(
        web_root,
        gpu_count=2,
        model="m",
        deployment="dep-a",
        name="my-gpu",
        accelerators=["GPU-real-1", "SIM-abc"],
        cpuset="",
    )
    result = run(executor, "start", spec=spec)
    assert result["status"] == "succeeded", result["detail"]
    assert result["output"]["ignored_spec_keys"] == ["gpu_count"]
    assert result["containers"][0]["name"] == "my-gpu"


def test_bad_specs_and_actions_fail_clearly(executor: CommandExecutor) -> None:
    assert "spec.command: command or args is required" in str(
        run(executor, "start", spec={"port": 1})["detail"]
    )
    assert "spec.command: the process runtime has no image entrypoint" in str(
        run(executor, "start", spec={"args": ["--port", "1"]})["detail"]
    )
    assert "exited with code 1" in str(
        run(executor, "start", spec={"command": ["/bin/false"]})["detail"]
    )
    assert "unknown action 'explode'" in str(run(executor, "explode")["detail"])
    missing = run(executor, "start", spec={"command": ["/nonexistent/engine"], "port": 1})
    assert missing["status"] == "failed"
    assert str(missing["detail"]).startswith("GPU engine exited with code 127: launcher: cannot")


def test_a_failed_start_names_its_cause_first() -> None:
    from agents.commands import engine_cause

    usage = "usage: api_server.py [-h]\n  [--model MODEL]"
    tail = usage + "\napi_server.py: error: unrecognized arguments: --preemption-mode swap"
    assert engine_cause(tail) == (
        "api_server.py: error: unrecognized arguments: --preemption-mode swap"
    )
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\n'
    trace += "ModuleNotFoundError: No module named 'syshax_kv_connector'\nINFO shutting down"
    assert engine_cause(trace) == "ModuleNotFoundError: No module named 'syshax_kv_connector'"
    assert engine_cause("engine listening\nall fine") is None
    assert engine_cause("error: first line only") == "error: first line only"


# The ends of real vLLM 0.32 logs (tests/realengine/test_engine_start_errors.py provokes them):
# pydantic's summary names only the class; the message under it is the cause.
MAX_MODEL_LEN_LOG = """\
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (2048) is greater than the derived max_model_len \
(max_position_embeddings=1024.0 or model_max_length=None in model's config.json). To allow \
overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. [type=value_error, \
input_value=ArgsKwargs((), {'model': ...}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
NO_CONFIG_LOG = """\
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, Invalid repository ID or local directory specified: '/models/none'.
Please verify the following requirements:
1. Provide a valid Hugging Face repository ID.
 [type=value_error, input_value=ArgsKwargs((), {'model': ...}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
ENGINE_CORE_LOG = """\
ValueError: this engine core refuses
(EngineCore pid=1) ERROR EngineCore failed to start.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_cause_of_a_refused_configuration_is_vllms_own_sentence() -> None:
    from agents.commands import CAUSE_CHARS, engine_cause

    cause = engine_cause(MAX_MODEL_LEN_LOG)
    assert cause is not None
    assert cause.startswith("User-specified max_model_len (2048) is greater than the derived")
    assert "[type=" not in cause and "\n" not in cause
    assert engine_cause(NO_CONFIG_LOG) == (
        "Invalid repository ID or local directory specified: '/models/none'."
    )
    # A generic "see above" is passed over for the line that says what failed.
    assert engine_cause(ENGINE_CORE_LOG) == "ValueError: this engine core refuses"
    # An unsupported architecture's message lists every architecture: one line, cut short.
    long = "pydantic_core.ValidationError: 1 validation error for ModelConfig\n  Value error, "
    long += "Model architectures ['FooForCausalLM'] are not supported for now. Supported: "
    long += ", ".join(f"'Arch{i}'" for i in range(500)) + " [type=value_error]\n"
    cause = engine_cause(long)
    assert cause is not None and len(cause) == CAUSE_CHARS and cause.endswith("…")
    assert cause.startswith("Model architectures ['FooForCausalLM'] are not supported")


def test_a_model_the_engine_cannot_serve_fails_before_it_starts(
    executor: CommandExecutor, process_runtime: ProcessRuntime, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    model = tmp_path / "small-llama"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 1024})
    )
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]

    def start(*args: str) -> str:
        spec = {"command": command, "args": list(args), "port": 1, "health_timeout_seconds": 5}
        result = run(executor, "start", spec=spec)
        assert result["status"] == "failed", result
        return str(result["detail"])

    assert start("--model", str(tmp_path / "nowhere")) == (
        f"spec.args --model: {tmp_path / 'nowhere'} does not exist"
    )
    assert start("--model", str(tmp_path)) == f"spec.args --model: {tmp_path} has no config.json"
    assert start(f"--model={model}", "--max-model-len", "2048") == (
        f"spec.args --max-model-len: 2048 is more than the model allows: 1024 "
        f"(max_position_embeddings in {model}/config.json)"
    )
    assert not marker.exists()  # no engine was started for any of them
    assert process_runtime.list({}) == []
