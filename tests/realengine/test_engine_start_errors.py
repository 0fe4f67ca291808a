"""Real vLLM 0.32 started through the agent's start command on the process runtime: an engine
that cannot start fails the command with a detail naming the role and vLLM's own cause, and the
KV connector the agent puts on PYTHONPATH is what lets the same engine start.

One vLLM process at a time, bound to one CPU. The failing engines exit within about 30 s, well
inside their 600 s health timeout, so the time asserted is what "fails fast" means here.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agents.commands import CommandExecutor
from agents.engine_policy import EnginePolicy
from agents.runtimes.process import ProcessRuntime
from common.engine_spec import KV_CONNECTOR_MODULE, kv_transfer_config
from common.supervisor import free_port
from testbed.vllm_env import ensure_tiny_model, ensure_vllm

pytestmark = pytest.mark.timeout(900)

HEALTH_TIMEOUT = 600
# A failing engine is reported this long after the start at most: vLLM's own start-up before
# it rejects its arguments or fails to load its connector, with room for two busy cores.
FAILS_WITHIN = 180
ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    # Nothing inherited: without the spec's kv_connector mark the connector is not importable.
    "PYTHONPATH": "",
}


@pytest.fixture
def process_runtime(tmp_path: Path) -> Iterator[ProcessRuntime]:
    runtime = ProcessRuntime(tmp_path / "state")
    yield runtime
    for engine in runtime.list({}):  # never leave an engine behind
        runtime.stop(engine.engine_id, timeout=30)


@pytest.fixture
def executor(process_runtime: ProcessRuntime, tmp_path: Path) -> CommandExecutor:
    # The agent's default policy, with the vLLM venv's interpreter named (--engine-python).
    policy = EnginePolicy(interpreters=(str(ensure_vllm()),))
    return CommandExecutor(
        process_runtime, node="node-a", state_dir=tmp_path / "state", policy=policy
    )


def vllm_spec(*extra_args: str, **extra: Any) -> dict[str, Any]:
    """The spec of one real vLLM OpenAI server serving the tiny model on a free port."""
    port = free_port()
    args = [
        "--model", str(ensure_tiny_model()),
        "--served-model-name", "tiny",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", "512",
        *extra_args,
    ]  # fmt: skip
    spec: dict[str, Any] = {
        "command": [str(ensure_vllm()), "-m", "vllm.entrypoints.openai.api_server"],
        "args": args,
        "env": ENGINE_ENV,
        "port": port,
        "health_timeout_seconds": HEALTH_TIMEOUT,
    }
    spec.update(extra)
    return spec


def connector_args(shm: Path) -> tuple[str, str]:
    """The agent's own ``--kv-transfer-config``, naming module ``syshax_kv_connector``."""
    shm.mkdir(exist_ok=True)
    config = kv_transfer_config("gpu", "gpu", shm_dir=str(shm))
    assert json.loads(config)["kv_connector_module_path"] == KV_CONNECTOR_MODULE
    return "--kv-transfer-config", config


def start(
    executor: CommandExecutor, spec: dict[str, Any], role: str = "gpu"
) -> tuple[dict[str, Any], float]:
    """Execute a start command the way the consumer does; the result and its seconds."""
    began = time.monotonic()
    result = executor.execute(
        dispatch_id=str(uuid.uuid4()),
        action="start",
        deployment_id=7,
        generation=1,
        role=role,
        spec=spec,
    )
    return result, time.monotonic() - began


def engine_log(process_runtime: ProcessRuntime, role: str) -> str:
    return (process_runtime.logs_dir / f"syshax-7-g1-{role}.log").read_text(errors="replace")


def test_a_flag_vllm_v1_rejects_fails_fast_naming_the_role_and_the_flag(
    executor: CommandExecutor, process_runtime: ProcessRuntime
) -> None:
    spec = vllm_spec("--preemption-mode", "swap", ipc="private")
    result, seconds = start(executor, spec, role="cpu")
    detail = str(result["detail"])
    assert result["status"] == "failed", result
    assert detail.startswith("CPU engine exited with code 2: "), detail  # argparse's code
    # The cause comes first, before the usage text of the log's tail.
    cause = detail.removeprefix("CPU engine exited with code 2: ").split(" | ")[0]
    assert "error: unrecognized arguments: --preemption-mode" in cause, detail
    assert "unrecognized arguments: --preemption-mode" in detail, engine_log(process_runtime, "cpu")
    assert seconds < FAILS_WITHIN
    assert [c["status"] for c in result["containers"]] == ["missing"]
    assert process_runtime.list({}) == []  # nothing orphaned


def test_a_connector_that_is_not_importable_fails_naming_the_missing_module(
    executor: CommandExecutor, process_runtime: ProcessRuntime, tmp_path: Path
) -> None:
    spec = vllm_spec(*connector_args(tmp_path / "shm"))
    assert "kv_connector" not in spec  # unmarked: the agent adds nothing to PYTHONPATH
    result, seconds = start(executor, spec)
    detail = str(result["detail"])
    assert result["status"] == "failed", result
    assert detail.startswith("GPU engine exited with code 1: "), detail
    cause = detail.removeprefix("GPU engine exited with code 1: ").split(" | ")[0]
    assert cause.startswith("ModuleNotFoundError: No module named"), detail
    assert f"No module named '{KV_CONNECTOR_MODULE}'" in detail, (
        detail + "\n--- whole log ---\n" + engine_log(process_runtime, "gpu")
    )
    assert seconds < FAILS_WITHIN
    assert process_runtime.list({}) == []


def test_the_same_engine_marked_kv_connector_starts_healthy_and_stops(
    executor: CommandExecutor, process_runtime: ProcessRuntime, tmp_path: Path
) -> None:
    shm = tmp_path / "shm"
    spec = vllm_spec(*connector_args(shm), kv_connector=True)
    result, _ = start(executor, spec)
    assert result["status"] == "succeeded", result["detail"]
    # vLLM really loaded the agent's copy of the connector, with the spec's configuration.
    assert f"SyshaxShmConnector gpu (scheduler): shm {shm}" in engine_log(process_runtime, "gpu")
    (container,) = result["containers"]
    assert container["health"] == "healthy" and container["status"] == "running"
    assert result["output"]["endpoint"] == f"http://127.0.0.1:{spec['port']}"
    (engine,) = process_runtime.list({})
    launcher = psutil.Process(int(engine.extra["pid"]))
    engine_processes = [launcher, *launcher.children(recursive=True)]

    stopped = executor.execute(
        dispatch_id=str(uuid.uuid4()), action="stop", deployment_id=7, role=None, spec={}
    )
    assert stopped["status"] == "succeeded", stopped
    assert stopped["detail"] == "stopped 1 engine(s)"
    assert process_runtime.list({}) == []
    _, alive = psutil.wait_procs(engine_processes, timeout=30)
    assert alive == [], f"engine processes left behind: {alive}"


def with_model(spec: dict[str, Any], model: Path, length: str) -> dict[str, Any]:
    args = list(spec["args"])
    args[args.index("--model") + 1] = str(model)
    args[args.index("--max-model-len") + 1] = length
    return {**spec, "args": args}


def test_a_context_longer_than_the_models_fails_before_any_engine_starts(
    executor: CommandExecutor, process_runtime: ProcessRuntime
) -> None:
    wide = ensure_tiny_model(wide=True)  # 1,024 positions
    result, seconds = start(executor, with_model(vllm_spec(), wide, "2048"))
    assert result["status"] == "failed", result
    assert result["detail"] == (
        f"spec.args --max-model-len: 2048 is more than the model allows: 1024 "
        f"(max_position_embeddings in {wide}/config.json)"
    )
    assert seconds < 5  # the agent's own check: no engine was started
    assert process_runtime.list({}) == []


def test_an_architecture_vllm_does_not_have_is_vllms_own_sentence_first(
    executor: CommandExecutor, process_runtime: ProcessRuntime, tmp_path: Path
) -> None:
    model = tmp_path / "foo-model"
    model.mkdir()
    for part in ensure_tiny_model().iterdir():
        (model / part.name).symlink_to(part)
    config = json.loads((ensure_tiny_model() / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    result, seconds = start(executor, with_model(vllm_spec(), model, "512"))
    detail = str(result["detail"])
    assert result["status"] == "failed", result
    cause, where, _ = detail.removeprefix("GPU engine exited with code 1: ").split(" | ", 2)
    # pydantic's summary ("1 validation error for ModelConfig") and its carets are passed over.
    assert cause.startswith("Model architectures ['FooForCausalLM'] are not supported"), detail
    assert len(cause) <= 400 and "\n" not in cause
    log = Path(where.removeprefix("full log: node-a:"))
    assert "FooForCausalLM" in log.read_text()  # the whole log, kept after the engine is gone
    assert seconds < FAILS_WITHIN
    assert process_runtime.list({}) == []
