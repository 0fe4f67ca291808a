"""The Docker-API runtime against a real engine: Podman's Docker-compatible service."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_helpers import IMAGE, free_port, host_mounts, http_engine_spec

from agents.commands import CommandExecutor
from agents.engine_policy import EnginePolicy
from agents.runtimes.dockerapi import DockerRuntime
from common.containers import container_kwargs
from common.engine_spec import EngineSpec, Mount, SpecError, kv_connector_dir


def mounted(*extra: Path, any_engine: bool = False) -> EnginePolicy:
    """The policy of an agent started with ``--mount`` for each of :func:`host_mounts` and
    ``--allow-image`` for the test image; ``any_engine`` adds ``--allow-any-engine``, which
    the stand-in engines (``python -m http.server``, ``python -c``) need."""
    mounts = tuple(Mount(str(m["source"]), str(m["target"])) for m in host_mounts(*extra))
    return EnginePolicy(mounts=mounts, allow_images=(IMAGE,), allow_any_engine=any_engine)


def container_spec(root: Path, **extra: Any) -> dict[str, Any]:
    return http_engine_spec(root, image=IMAGE, mounts=host_mounts(root), **extra)


def run(
    executor: CommandExecutor,
    action: str,
    role: str | None,
    spec: dict[str, Any] | None,
    deployment_id: int = 11,
    generation: int = 1,
) -> dict[str, Any]:
    return executor.execute(
        dispatch_id=str(uuid.uuid4()),
        action=action,
        deployment_id=deployment_id,
        generation=generation,
        role=role,
        spec=spec,
    )


def shm(runtime: DockerRuntime, engine_id: str, code: str) -> tuple[int, str]:
    container = runtime.client.containers.get(engine_id)
    exit_code, out = container.exec_run([sys.executable, "-c", code])
    return int(exit_code), out.decode(errors="replace").strip()


def test_container_kwargs_for_the_gpu_and_cpu_engines() -> None:
    gpu = EngineSpec.from_dict(
        {
            "command": ["vllm"],
            "args": ["--port", "7001"],
            "image": "vllm:x",
            "port": 7001,
            "shm_size_bytes": 8 << 30,
            "restart_policy": "on-failure",
            "accelerators": [{"uuid": "GPU-1", "index": 0}, {"uuid": "SIM-2", "simulated": True}],
        }
    )
    kw = container_kwargs("syshax-1-g1-gpu", gpu, {"syshax.role": "gpu"}, "gpu", None)
    assert kw["ipc_mode"] == "shareable" and kw["shm_size"] == 8 << 30
    assert kw["network_mode"] == "host" and kw["command"] == ["vllm", "--port", "7001"]
    assert kw["restart_policy"] == {"Name": "on-failure", "MaximumRetryCount": 5}
    (request,) = kw["device_requests"]
    assert request["DeviceIDs"] == ["GPU-1"]  # the simulated card gets no device request
    sim_only = EngineSpec.from_dict(
        {"command": ["s"], "accelerators": [{"uuid": "SIM-2", "simulated": True}]}
    )
    assert "device_requests" not in container_kwargs("n", sim_only, {}, "gpu", None)

    cpu = EngineSpec.from_dict(
        {
            "command": ["vllm"],
            "image": "vllm-cpu:x",
            "port": 7002,
            "cpuset": "4-27,40-63",
            "memory_limit_bytes": 64 << 30,
            "shm_size_bytes": 1 << 30,
            "env": {
                "OMP_NUM_THREADS": "48",
                "CUSTOM_CPU_AFFINITY": "4-27,40-63",
                "VLLM_CPU_KVCACHE_SPACE": "40",
            },
        }
    )
    kw = container_kwargs("syshax-1-g1-cpu", cpu, {}, "cpu", "abc123")
    assert kw["ipc_mode"] == "container:abc123" and "shm_size" not in kw
    assert kw["cpuset_cpus"] == "4-27,40-63" and kw["mem_limit"] == 64 << 30
    assert kw["environment"]["OMP_NUM_THREADS"] == "48"


def test_a_kv_connector_spec_mounts_the_connector_and_puts_it_on_pythonpath() -> None:
    spec = EngineSpec.from_dict(
        {
            "command": ["vllm"],
            "kv_connector": True,
            "env": {"PYTHONPATH": "/models/lib"},
            "mounts": [{"source": "/srv/old", "target": "/opt/syshax/kvconnector"}],
        }
    )
    kw = container_kwargs("syshax-1-g1-gpu", spec, {}, "gpu", None, kv_connector_source="/srv/kv")
    (mount,) = kw["mounts"]  # the node's own copy replaces a spec mount on the same target
    assert (mount["Source"], mount["Target"], mount["ReadOnly"]) == (
        "/srv/kv",
        "/opt/syshax/kvconnector",
        True,
    )
    assert kw["environment"]["PYTHONPATH"] == "/opt/syshax/kvconnector:/models/lib"
    plain = container_kwargs("n", replace(spec, env={}), {}, "gpu", None, "/srv/kv")
    assert plain["environment"]["PYTHONPATH"] == "/opt/syshax/kvconnector"
    without = container_kwargs("n", EngineSpec.from_dict({"command": ["vllm"]}), {}, "gpu", None)
    assert without["mounts"] == [] and "PYTHONPATH" not in without["environment"]
    with pytest.raises(SpecError, match="kv_connector"):
        container_kwargs("n", spec, {}, "gpu", None)


def test_ascend_npus_get_their_device_nodes_and_the_host_driver() -> None:
    """Mock-free but hardware-free: the create arguments an Ascend card would get."""
    npu = EngineSpec.from_dict(
        {
            "command": ["vllm"],
            "accelerators": ["NPU-2102312345", {"uuid": "NPU-9", "index": 1, "kind": "npu"}],
        }
    )
    assert [a.kind for a in npu.accelerators] == ["npu", "npu"]
    kw = container_kwargs("syshax-1-g1-gpu", npu, {}, "gpu", None)
    assert "device_requests" not in kw
    assert kw["devices"][:2] == [
        "/dev/davinci0:/dev/davinci0:rwm",
        "/dev/davinci1:/dev/davinci1:rwm",
    ]
    assert "/dev/davinci_manager:/dev/davinci_manager:rwm" in kw["devices"]
    driver = [m for m in kw["mounts"] if m["Target"] == "/usr/local/Ascend/driver"]
    assert driver and driver[0]["ReadOnly"] is True


def test_gpu_then_cpu_share_one_ipc_namespace_on_podman(
    docker_runtime: DockerRuntime, web_root: Path, tmp_path: Path
) -> None:
    executor = CommandExecutor(
        docker_runtime,
        node="node-a",
        state_dir=tmp_path / "state",
        policy=mounted(web_root, any_engine=True),
    )
    refused = run(executor, "start", "cpu", container_spec(web_root))
    assert "IPC peer GPU engine syshax-11-g1-gpu is not running" in refused["detail"]

    gpu_spec = container_spec(web_root, shm_size_bytes=64 << 20, kv_connector=True)
    gpu = run(executor, "start", "gpu", gpu_spec)
    assert gpu["status"] == "succeeded", gpu["detail"]
    assert gpu["containers"][0]["health"] == "healthy"
    # The node's copy of the KV connector is importable inside the engine's container.
    found = "import importlib.util as u; print(u.find_spec('syshax_kv_connector').origin)"
    assert shm(docker_runtime, gpu["containers"][0]["engine_id"], found) == (
        0,
        "/opt/syshax/kvconnector/syshax_kv_connector.py",
    )
    assert (kv_connector_dir() / "syshax_kv_connector.py").is_file()
    cpu = run(
        executor,
        "start",
        "cpu",
        container_spec(
            web_root,
            cpuset="0",
            memory_limit_bytes=512 << 20,
            env={"OMP_NUM_THREADS": "1", "CUSTOM_CPU_AFFINITY": "0"},
        ),
    )
    assert cpu["status"] == "succeeded", cpu["detail"]
    gpu_id, cpu_id = gpu["containers"][0]["engine_id"], cpu["containers"][0]["engine_id"]

    attrs = docker_runtime.client.containers.get(cpu_id).attrs
    assert attrs["HostConfig"]["IpcMode"] == f"container:{gpu_id}"
    assert attrs["HostConfig"]["CpusetCpus"] == "0"
    assert attrs["HostConfig"]["Memory"] == 512 << 20
    assert attrs["Config"]["Labels"]["syshax.generation"] == "1"
    assert "OMP_NUM_THREADS=1" in attrs["Config"]["Env"]

    # A segment written in the GPU engine's /dev/shm is visible to the CPU engine ...
    assert (
        shm(docker_runtime, gpu_id, "open('/dev/shm/syshax-probe','w').write('kv-blocks')")[0] == 0
    )
    assert shm(docker_runtime, cpu_id, "print(open('/dev/shm/syshax-probe').read())") == (
        0,
        "kv-blocks",
    )
    # ... and the same engine set up without the shared namespace cannot see it.
    private = run(
        executor, "start", "cpu", container_spec(web_root, ipc="private"), deployment_id=12
    )
    assert private["status"] == "succeeded", private["detail"]
    code, out = shm(
        docker_runtime,
        private["containers"][0]["engine_id"],
        "print(open('/dev/shm/syshax-probe').read())",
    )
    assert code != 0 and "FileNotFoundError" in out

    again = run(executor, "start", "cpu", container_spec(web_root))
    assert again["output"]["adopted"] is True  # same generation: same container
    assert len(docker_runtime.list({"syshax.deployment": "11"})) == 2

    stopped = run(executor, "stop", None, None)
    assert [c["role"] for c in stopped["containers"]] == ["cpu", "gpu"]
    assert docker_runtime.list({"syshax.deployment": "11"}) == []


def any_engine_executor(docker_runtime: DockerRuntime, tmp_path: Path) -> CommandExecutor:
    """An agent that runs any engine: these tests start shell one-liners in the image."""
    return CommandExecutor(
        docker_runtime,
        node="node-a",
        state_dir=tmp_path / "state",
        policy=mounted(any_engine=True),
    )


def test_a_failing_container_reports_its_exit_code_and_logs_and_is_removed(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    executor = any_engine_executor(docker_runtime, tmp_path)
    spec = {
        "command": [sys.executable, "-c", "print('CUDA out of memory'); raise SystemExit(2)"],
        "image": IMAGE,
        "port": 1,
        "mounts": host_mounts(),
        "restart_policy": "no",
        "health_timeout_seconds": 30,
    }
    result = run(executor, "start", "gpu", spec, deployment_id=13)
    assert result["status"] == "failed"
    assert result["detail"].startswith("GPU engine exited with code 2: CUDA out of memory")
    assert docker_runtime.list({"syshax.deployment": "13"}) == []


def test_a_container_that_cannot_start_is_not_left_behind(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    executor = any_engine_executor(docker_runtime, tmp_path)
    # Created, then refused at start: the program does not exist in the image.
    spec = {
        "command": ["/nonexistent/engine"],
        "image": IMAGE,
        "port": 1,
        "mounts": host_mounts(),
        "restart_policy": "no",
        "health_timeout_seconds": 30,
    }
    result = run(executor, "start", "gpu", spec, deployment_id=14)
    assert result["status"] == "failed"
    assert result["detail"].startswith("container engine refused syshax-14-g1-gpu: "), result
    assert docker_runtime.list({"syshax.deployment": "14"}) == []
    names = [c.name for c in docker_runtime.client.containers.list(all=True)]
    assert "syshax-14-g1-gpu" not in names


def sim_spec(device: str, **extra: Any) -> dict[str, Any]:
    port = free_port()
    return {
        "image": IMAGE,
        "command": [sys.executable, "-m", "syshax.cli", "sim"],
        "args": [
            "--device",
            device,
            "--model",
            "qwen2.5-7b-instruct",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--speed",
            "50",
            "--syshax-compat",  # the handoff below uses sysHAX's request fields
        ],
        "port": port,
        "mounts": host_mounts(),
        "health_timeout_seconds": 60,
        **extra,
    }


def completion(port: int, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=30,
        json={"model": "qwen2.5-7b-instruct", "prompt": "hello there", **body},
    )


def test_simulator_kv_handoff_works_across_the_shared_ipc_namespace_only(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    executor = CommandExecutor(
        docker_runtime, node="node-a", state_dir=tmp_path / "state", policy=mounted()
    )
    gpu_spec = sim_spec("a100-80gb", shm_size_bytes=256 << 20)
    cpu_spec = sim_spec(
        "xeon-8480", cpuset="0-1", env={"OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    lone_spec = sim_spec("xeon-8480", ipc="private")
    for role, spec, dep in (("gpu", gpu_spec, 21), ("cpu", cpu_spec, 21), ("cpu", lone_spec, 22)):
        started = run(executor, "start", role, spec, deployment_id=dep)
        assert started["status"] == "succeeded", started["detail"]

    def prefill() -> dict[str, Any]:
        answer = completion(gpu_spec["port"], {"max_tokens": 8, "num_decode_tokens": 0})
        assert answer.status_code == 200, answer.text
        data: dict[str, Any] = answer.json()
        assert data["choices"][0]["finish_reason"] == "scheduled"
        return data

    def decode(port: int, first: dict[str, Any]) -> httpx.Response:
        return completion(
            port,
            {
                "max_tokens": 7,
                "num_decode_tokens": 4,
                "request_id_inference": first["id"],
                "generated_text": first["choices"][0]["text"],
            },
        )

    first = prefill()
    handed = decode(cpu_spec["port"], first)
    assert handed.status_code == 200, handed.text  # the CPU container read the GPU's segment
    assert handed.json()["id"] == first["id"]

    refused = decode(lone_spec["port"], prefill())
    assert refused.status_code == 404  # another IPC namespace: the segment is not there
    assert "ipc" in refused.text.lower()


def test_rendered_docker_run_lines_make_the_containers_the_agent_makes(
    docker_runtime: DockerRuntime, podman_service: dict[str, str], web_root: Path
) -> None:
    """``syshax profile render --docker`` prints ``docker_run_argv(container_kwargs(...))``: the
    real docker CLI running those lines against the same engine creates containers configured
    as the agent's own, and the CPU engine shares the GPU engine's /dev/shm."""
    import shutil
    import subprocess

    from common.containers import docker_run_argv

    docker = shutil.which("docker")
    assert docker, "the docker CLI is needed to run the rendered lines"
    env = {**os.environ, "DOCKER_HOST": podman_service["DOCKER_HOST"]}
    tag = uuid.uuid4().hex[:6]

    def engine_specs() -> dict[str, EngineSpec]:  # each its own port: host networking
        return {
            "gpu": EngineSpec.from_dict(container_spec(web_root, shm_size_bytes=64 << 20)),
            "cpu": EngineSpec.from_dict(
                container_spec(
                    web_root,
                    cpuset="0",
                    memory_limit_bytes=256 << 20,
                    env={"OMP_NUM_THREADS": "1"},
                )
            ),
        }

    made: dict[str, dict[str, Any]] = {}
    for way in ("agent", "cli"):
        specs = engine_specs()
        gpu_name = f"render-{tag}-{way}-gpu"
        for role in ("gpu", "cpu"):
            name = f"render-{tag}-{way}-{role}"
            labels = {"syshax.node": "node-a", "syshax.role": role}
            if way == "agent":
                peer = docker_runtime.inspect(made[f"{way}-gpu"]["Id"]) if role == "cpu" else None
                state = docker_runtime.start(name, specs[role], labels, peer)
                engine_id = state.engine_id
            else:
                # The runtime adds where the engine listens to the labels it is given.
                spec = specs[role]
                labels |= {"syshax.port": str(spec.port), "syshax.host": spec.host}
                kwargs = container_kwargs(
                    name, spec, labels, role, gpu_name if role == "cpu" else None
                )
                argv = docker_run_argv(kwargs)
                argv[0] = docker
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr
                engine_id = done.stdout.strip()
            made[f"{way}-{role}"] = docker_runtime.client.containers.get(engine_id).attrs

    def shape(attrs: dict[str, Any], gpu_id: str) -> dict[str, Any]:
        host, config = attrs["HostConfig"], attrs["Config"]
        return {
            "ipc": host["IpcMode"].replace(gpu_id, "<gpu>"),
            "cpuset": host["CpusetCpus"],
            "memory": host["Memory"],
            "shm": host["ShmSize"] if host["IpcMode"] == "shareable" else None,
            "network": host["NetworkMode"],
            "restart": host["RestartPolicy"]["Name"],
            "mounts": sorted((m["Source"], m["Destination"], m["RW"]) for m in attrs["Mounts"]),
            "cmd": [a for a in config["Cmd"] if not a.isdigit()],  # all but the port
            "image": config["Image"],
            "env": sorted(e for e in config["Env"] if e.startswith("OMP_NUM_THREADS=")),
            "labels": sorted(k for k in config["Labels"] if k.startswith("syshax.")),
        }

    for role in ("gpu", "cpu"):
        agent = shape(made[f"agent-{role}"], made["agent-gpu"]["Id"])
        cli = shape(made[f"cli-{role}"], made["cli-gpu"]["Id"])
        assert agent == cli, role
    assert shape(made["cli-cpu"], made["cli-gpu"]["Id"])["ipc"] == "container:<gpu>"
    cli_gpu, cli_cpu = made["cli-gpu"]["Id"], made["cli-cpu"]["Id"]
    assert shm(docker_runtime, cli_gpu, "open('/dev/shm/render-probe','w').write('kv')")[0] == 0
    assert shm(docker_runtime, cli_cpu, "print(open('/dev/shm/render-probe').read())") == (0, "kv")
    for key in ("agent-cpu", "cli-cpu", "agent-gpu", "cli-gpu"):
        docker_runtime.stop(made[key]["Id"], timeout=2)
