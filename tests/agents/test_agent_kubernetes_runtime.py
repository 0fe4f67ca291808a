"""The Kubernetes runtime: engine pairs as one pod on the agent's node, against a stand-in API.

No Kubernetes API server can run here, so the runtime's real ``kubernetes`` client talks to
``standin_kubernetes_api.StandInKubernetesAPI``: a stand-in that follows the API's documented
semantics (pod phases, container states, the PodScheduled condition, graceful deletion,
Status errors) with every transition driven by the test. The pods it is given are also
validated strictly against the Kubernetes 1.34-1.37 schemas; the pods of the built-in profiles
are in tests/deploy/test_engine_pods.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes_validate
import pytest
from standin_kubernetes_api import StandInKubernetesAPI

from agents.cli import add_arguments, build_config
from agents.commands import CommandExecutor
from agents.engine_policy import EnginePolicy
from agents.main import AgentConfig, make_runtime
from agents.runtimes import EngineRuntimeError, EngineState
from agents.runtimes.kubernetes import KubernetesRuntime, NodeCapacity
from agents.runtimes.kubernetes_pod import PodEngine, PodOptions, engine_pod
from common.engine_spec import Accelerator, EngineSpec, engine_labels, kv_transfer_config

GIB = 1024**3
NODE = "gpu-node-1"
NAMESPACE = "syshax-engines"
KUBERNETES_VERSIONS = ("1.34", "1.35", "1.36", "1.37")
ANY_ENGINE = EnginePolicy(allow_any_engine=True)


@pytest.fixture
def api() -> Iterator[StandInKubernetesAPI]:
    server = StandInKubernetesAPI(node=NODE)
    server.start()
    yield server
    server.stop()


def runtime_for(api: StandInKubernetesAPI, **capacity: int) -> KubernetesRuntime:
    configuration = kubernetes.client.Configuration()
    configuration.host = api.url
    return KubernetesRuntime(
        PodOptions(namespace=NAMESPACE, node=NODE),
        configuration=configuration,
        capacity=NodeCapacity(
            cpus=capacity.get("cpus", 96), memory_bytes=capacity.get("memory", 512 * GIB)
        ),
        delete_wait=3.0,
        poll_interval=0.01,
    )


@pytest.fixture
def runtime(api: StandInKubernetesAPI) -> KubernetesRuntime:
    return runtime_for(api)


def labels(role: str, deployment: int = 7, generation: int = 1) -> dict[str, str]:
    return engine_labels(
        node=NODE, deployment_id=deployment, generation=generation, role=role, dispatch_id="d-1"
    )


def gpu_spec(port: int = 7001, **extra: Any) -> EngineSpec:
    config = kv_transfer_config("syshax-7-g1-gpu", "syshax-7-g1-cpu", arena_mib=4096)
    spec = EngineSpec(
        command=("vllm", "serve"),
        args=("--model", "/models/qwen", "--port", str(port), "--kv-transfer-config", config),
        image="vllm/vllm-openai:v0.32.0",
        port=port,
        cpuset="0-3",
        shm_size_bytes=2 * GIB,
        accelerators=(Accelerator("GPU-aaaa", 0),),
        ipc="shareable",
        kv_connector=True,
        health_timeout_seconds=5,
    )
    return replace(spec, **extra)


def cpu_spec(port: int = 7002, **extra: Any) -> EngineSpec:
    spec = EngineSpec(
        command=("vllm", "serve"),
        args=("--model", "/models/qwen", "--port", str(port)),
        image="vllm/vllm-cpu:v0.32.0",
        env={"VLLM_CPU_OMP_THREADS_BIND": "8-23", "OMP_NUM_THREADS": "16"},
        port=port,
        cpuset="8-23",
        memory_limit_bytes=64 * GIB,
        ipc="peer",
        kv_connector=True,
        health_timeout_seconds=5,
    )
    return replace(spec, **extra)


def validate_strictly(pod: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)


def start_pair(runtime: KubernetesRuntime, api: StandInKubernetesAPI) -> tuple[str, str]:
    gpu = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    api.run("syshax-7-g1")
    peer = runtime.inspect(gpu.engine_id)
    assert peer is not None and peer.status == "running"
    cpu = runtime.start("syshax-7-g1-cpu", cpu_spec(), labels("cpu"), peer)
    return gpu.engine_id, cpu.engine_id


# ---------------------------------------------------------------- the pod


def test_the_gpu_start_makes_a_pod_of_the_gpu_engine_found_by_its_labels(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    state = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    assert (state.engine_id, state.name, state.status) == (
        "syshax-7-g1/gpu",
        "syshax-7-g1-gpu",
        "created",
    )
    assert state.endpoint == "http://127.0.0.1:7001"
    (pod,) = api.created
    validate_strictly(pod)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["gpu"]
    assert pod["metadata"]["labels"]["syshax.io/deployment"] == "7"
    api.run("syshax-7-g1")
    (listed,) = runtime.list({"syshax.deployment": "7", "syshax.role": "gpu"})
    assert listed.status == "running" and listed.labels == labels("gpu")
    assert runtime.list({"syshax.deployment": "8"}) == []
    assert runtime.list({"syshax.role": "cpu"}) == []


def test_the_cpu_start_makes_the_pair_pod_with_the_gpu_engine_as_a_native_sidecar(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    gpu_id, cpu_id = start_pair(runtime, api)
    assert (gpu_id, cpu_id) == ("syshax-7-g1/gpu", "syshax-7-g1/cpu")  # the GPU's id holds
    pair = api.created[-1]
    validate_strictly(pair)
    spec = pair["spec"]
    copier, gpu = spec["initContainers"]
    (cpu,) = spec["containers"]
    # The connector first, then the GPU engine, which keeps running; the CPU engine starts
    # once the GPU engine's startup probe passes.
    assert copier["name"] == "kv-connector" and "restartPolicy" not in copier
    assert gpu["name"] == "gpu" and gpu["restartPolicy"] == "Always"
    assert gpu["startupProbe"]["httpGet"] == {"path": "/health", "port": 7001, "host": "127.0.0.1"}
    assert cpu["name"] == "cpu"
    # One /dev/shm in memory for both, sized for the 4 GiB arena and headroom.
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "5Gi"}
    for container in (gpu, cpu):
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["name"] == "dshm"
        assert mounts["/opt/syshax/kvconnector"]["readOnly"] is True
        assert mounts["/models/qwen"]["readOnly"] is True
    assert spec["hostNetwork"] is True
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [NODE]
    api.run("syshax-7-g1")
    states = {s.role: s for s in runtime.list({"syshax.deployment": "7"})}
    assert {r: s.status for r, s in states.items()} == {"gpu": "running", "cpu": "running"}


def test_every_container_is_guaranteed_with_whole_cpus_and_the_device_plugins_resource(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    start_pair(runtime, api)
    spec = api.created[-1]["spec"]
    containers = {c["name"]: c for c in spec["initContainers"] + spec["containers"]}
    for container in containers.values():
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], container["name"]
    gpu, cpu = containers["gpu"]["resources"]["limits"], containers["cpu"]["resources"]["limits"]
    assert gpu == {"cpu": "4", "memory": "21Gi", "nvidia.com/gpu": "1"}  # 16 GiB + /dev/shm
    assert cpu == {"cpu": "16", "memory": "64Gi"}  # the plan's 16 CPUs become the request
    env = {e["name"]: e["value"] for e in containers["cpu"]["env"]}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # the CPU manager picks the CPUs
    assert env["OMP_NUM_THREADS"] == "16"
    assert env["PYTHONPATH"] == "/opt/syshax/kvconnector"
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_an_npu_engine_asks_for_the_ascend_plugins_resource_and_mounts_the_driver() -> None:
    spec = gpu_spec(accelerators=(Accelerator("NPU-1", 0, kind="npu"),))
    pod = engine_pod([PodEngine("gpu", "syshax-1-g1-gpu", spec)], PodOptions(node=NODE))
    validate_strictly(pod)
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/usr/local/Ascend/driver" in mounts


def test_a_model_claim_is_mounted_at_its_root_and_a_model_outside_it_refused() -> None:
    options = PodOptions(node=NODE, model_claim="models", model_root="/models")
    pod = engine_pod([PodEngine("gpu", "syshax-1-g1-gpu", gpu_spec())], options)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
    assert volume == {"name": "model", "persistentVolumeClaim": {"claimName": "models"}}
    outside = gpu_spec(args=("--model", "/srv/qwen"))
    with pytest.raises(ValueError, match="not under /models, where claim models is mounted"):
        engine_pod([PodEngine("gpu", "syshax-1-g1-gpu", outside)], options)


# ---------------------------------------------------------------- lifecycle


def test_stop_removes_the_pod_and_inspect_of_a_vanished_engine_answers_none(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    gpu_id, cpu_id = start_pair(runtime, api)
    runtime.stop(cpu_id)  # containers of a pod go together
    assert runtime.inspect(cpu_id) is None and runtime.inspect(gpu_id) is None
    runtime.stop(gpu_id)  # already gone: not an error
    assert runtime.list({"syshax.deployment": "7"}) == []
    assert runtime.logs(gpu_id) == ""


def test_stop_waits_for_a_graceful_deletion_to_finish(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    state = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    api.run("syshax-7-g1")
    api.graceful = True
    threading.Timer(0.3, api.finish_deletion, ("syshax-7-g1",)).start()
    began = time.monotonic()
    runtime.stop(state.engine_id, timeout=5)
    assert time.monotonic() - began >= 0.25  # it waited for the pod to be gone
    assert runtime.inspect(state.engine_id) is None


def test_a_terminating_pod_reads_as_exited(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    state = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    api.run("syshax-7-g1")
    api.pod("syshax-7-g1")["metadata"]["deletionTimestamp"] = "2026-12-08T00:00:00Z"
    again = runtime.inspect(state.engine_id)
    assert again is not None and again.status == "exited"


def test_an_exit_code_survives_the_agents_restart(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    state = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    api.run("syshax-7-g1")
    api.exit("syshax-7-g1", "gpu", 3, log="loading\nValueError: no such model\n")
    restarted = runtime_for(api)  # a new agent: nothing in memory, the API remembers
    (found,) = restarted.list({"syshax.managed": "true", "syshax.node": NODE})
    assert (found.status, found.exit_code, found.extra["last_exit_code"]) == ("exited", 3, 3)
    assert found.extra["phase"] == "Failed"
    assert restarted.logs(state.engine_id).endswith("ValueError: no such model")


def test_a_lost_node_makes_the_engine_exited_with_the_cause(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    state = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    api.run("syshax-7-g1")
    api.node_lost("syshax-7-g1")
    lost = runtime.inspect(state.engine_id)
    assert lost is not None and lost.status == "exited" and lost.exit_code is None
    assert lost.extra["cause"] == (
        "pod syshax-7-g1 was stopped by its node (NodeLost error: "
        f"Node {NODE} which was running pod syshax-7-g1 is unresponsive)"
    )


def test_a_crash_loop_keeps_the_engines_own_error_and_names_the_pod(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    state = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    api.run("syshax-7-g1")
    api.crash_loop(
        "syshax-7-g1", "gpu", exit_code=1, restarts=4, log="RuntimeError: CUDA out of memory\n"
    )
    looping = runtime.inspect(state.engine_id)
    assert looping is not None
    assert (looping.status, looping.restarts, looping.extra["last_exit_code"]) == ("exited", 4, 1)
    assert runtime.logs(state.engine_id).splitlines() == [
        "RuntimeError: CUDA out of memory",
        "pod syshax-7-g1 container gpu is in CrashLoopBackOff after 4 restarts (last exit code 1)",
    ]


# ---------------------------------------------------------------- through the command layer


class _Engine(BaseHTTPRequestHandler):
    """An engine's health and models endpoints, answered 200."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = b'{"data": [{"id": "m"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def engine_port() -> Iterator[Callable[[], int]]:
    servers: list[ThreadingHTTPServer] = []

    def serve() -> int:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def when_created(api: StandInKubernetesAPI, count: int, act: Callable[[], None]) -> None:
    """Run ``act`` once the API has been asked for its ``count``-th pod (the executor waits)."""

    def wait() -> None:
        deadline = time.monotonic() + 5
        while len(api.created) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        act()

    threading.Thread(target=wait, daemon=True).start()


def execute(executor: CommandExecutor, role: str, spec: EngineSpec, n: int) -> dict[str, Any]:
    return executor.execute(
        dispatch_id=f"d-{n}",
        action="start",
        deployment_id=7,
        generation=1,
        role=role,
        spec={**spec.to_dict(), "name": f"syshax-7-g1-{role}"},
    )


@pytest.fixture
def executor(runtime: KubernetesRuntime, tmp_path: Path) -> CommandExecutor:
    return CommandExecutor(
        runtime, node=NODE, state_dir=tmp_path / "state", poll_interval=0.01, policy=ANY_ENGINE
    )


def test_a_deployment_starts_gpu_first_then_the_pair_and_stops_as_one_pod(
    executor: CommandExecutor, api: StandInKubernetesAPI, engine_port: Callable[[], int]
) -> None:
    gpu_port, cpu_port = engine_port(), engine_port()
    when_created(api, 1, lambda: api.run("syshax-7-g1"))
    gpu = execute(executor, "gpu", gpu_spec(gpu_port), 1)
    assert gpu["status"] == "succeeded", gpu["detail"]
    when_created(api, 2, lambda: api.run("syshax-7-g1"))
    cpu = execute(executor, "cpu", cpu_spec(cpu_port), 2)
    assert cpu["status"] == "succeeded", cpu["detail"]
    assert [len(p["spec"]["containers"]) for p in api.created] == [1, 1]
    assert [c["name"] for c in api.created[1]["spec"]["initContainers"]] == ["kv-connector", "gpu"]
    states = {s["role"]: s for s in executor.all_container_states()}
    assert {r: (s["status"], s["health"]) for r, s in states.items()} == {
        "gpu": ("running", "healthy"),
        "cpu": ("running", "healthy"),
    }
    assert states["gpu"]["engine_id"] == gpu["containers"][0]["engine_id"]
    stopped = executor.execute(dispatch_id="d-3", action="stop", deployment_id=7, spec={})
    assert stopped["output"]["stopped"] == ["syshax-7-g1-cpu", "syshax-7-g1-gpu"]
    assert api.pods == {}


@pytest.mark.parametrize(
    ("drive", "cause"),
    [
        (
            lambda api: api.unschedulable(
                "syshax-7-g1", "0/3 nodes are available: 1 Insufficient nvidia.com/gpu."
            ),
            "GPU engine exited: pod syshax-7-g1 cannot be scheduled (scheduler error: 0/3 nodes "
            "are available: 1 Insufficient nvidia.com/gpu.); it requests 4 CPUs, 21Gi, "
            "1 nvidia.com/gpu",
        ),
        (
            lambda api: api.image_pull_fails("syshax-7-g1", "gpu"),
            "GPU engine exited: pod syshax-7-g1 container gpu: image vllm/vllm-openai:v0.32.0 "
            "cannot be pulled (ImagePullBackOff error: Back-off pulling image "
            '"vllm/vllm-openai:v0.32.0": not found)',
        ),
    ],
    ids=["unschedulable", "image-pull"],
)
def test_what_keeps_a_pod_from_running_is_the_events_first_line_naming_the_pod(
    executor: CommandExecutor,
    api: StandInKubernetesAPI,
    drive: Callable[[StandInKubernetesAPI], None],
    cause: str,
) -> None:
    when_created(api, 1, lambda: drive(api))
    # The pod's cause ends the wait as soon as the runtime sees it; the health deadline only
    # bounds a busy machine's delay in seeing it (5 s was missed while engines started).
    result = execute(executor, "gpu", gpu_spec(health_timeout_seconds=60), 1)
    assert result["status"] == "failed"
    assert result["detail"].split(" | ")[0] == cause
    assert api.pods == {}  # the failed pod is removed, as a failed container is


def test_a_crash_loop_is_the_engines_own_error_first_and_the_pods_name_after(
    executor: CommandExecutor, api: StandInKubernetesAPI
) -> None:
    def crash() -> None:
        api.run("syshax-7-g1")
        api.crash_loop(
            "syshax-7-g1", "gpu", exit_code=1, restarts=3, log="ValueError: max_model_len too big"
        )

    when_created(api, 1, crash)
    result = execute(executor, "gpu", gpu_spec(), 1)
    first, *rest = result["detail"].split(" | ")
    assert first == "GPU engine exited with code 1: ValueError: max_model_len too big"
    assert "pod syshax-7-g1 container gpu is in CrashLoopBackOff after 3 restarts" in rest[-1]


def test_a_pod_that_cannot_fit_the_node_is_refused_with_the_numbers(
    api: StandInKubernetesAPI, tmp_path: Path
) -> None:
    small = runtime_for(api, cpus=8, memory=32 * GIB)
    with pytest.raises(EngineRuntimeError) as refused:
        small.start("syshax-7-g1-gpu", gpu_spec(cpuset="0-11"), labels("gpu"), None)
    assert str(refused.value) == (
        f"pod syshax-7-g1 cannot fit node {NODE}: it requests 12 CPUs, 21Gi, "
        "1 nvidia.com/gpu; the node has 8 CPUs and 32Gi of memory in all"
    )
    assert api.created == []


@pytest.mark.parametrize(
    ("verb", "resource", "act"),
    [
        ("create", "pods", lambda r: r.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)),
        ("list", "pods", lambda r: r.list({"syshax.deployment": "7"})),
        ("get", "pods", lambda r: r.inspect("syshax-7-g1/gpu")),
        ("delete", "pods", lambda r: r.stop("syshax-7-g1/gpu")),
    ],
    ids=["create", "list", "get", "delete"],
)
def test_a_service_account_without_a_right_says_which_verb_on_which_resource(
    runtime: KubernetesRuntime,
    api: StandInKubernetesAPI,
    verb: str,
    resource: str,
    act: Callable[[KubernetesRuntime], Any],
) -> None:
    if verb != "create":
        runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    with api.forbid(verb, resource), pytest.raises(EngineRuntimeError) as refused:
        act(runtime)
    target = "pods" if verb in ("create", "list") else 'pods "syshax-7-g1"'
    assert str(refused.value).startswith(
        f"the agent's ServiceAccount may not {verb} {resource} in namespace {NAMESPACE} "
        f'({target} is forbidden: User "system:serviceaccount:syshax:syshax-agent" cannot'
    )


def test_reading_logs_without_the_right_names_pods_log(
    runtime: KubernetesRuntime, api: StandInKubernetesAPI
) -> None:
    state = runtime.start("syshax-7-g1-gpu", gpu_spec(), labels("gpu"), None)
    api.run("syshax-7-g1")
    with api.forbid("get", "pods/log"), pytest.raises(EngineRuntimeError, match="may not get"):
        runtime.logs(state.engine_id)


def test_a_cpu_engine_whose_gpu_pod_is_gone_is_refused(runtime: KubernetesRuntime) -> None:
    ghost = EngineState("syshax-7-g1/gpu", "syshax-7-g1-gpu", labels("gpu"), "running")
    with pytest.raises(EngineRuntimeError, match="pod syshax-7-g1 is gone"):
        runtime.start("syshax-7-g1-cpu", cpu_spec(), labels("cpu"), ghost)


# ---------------------------------------------------------------- choosing the runtime


def test_the_agent_picks_the_kubernetes_runtime_from_its_flags_and_environment(
    api: StandInKubernetesAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    monkeypatch.setenv("SYSHAX_KUBERNETES_NAMESPACE", "engines-a")
    monkeypatch.setenv("SYSHAX_KUBERNETES_NODE", NODE)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--control-plane", "http://cp", "--token", "sxa_x", "--runtime", "kubernetes"]
    )
    config = build_config(args)
    assert (config.runtime, config.kubernetes_namespace, config.kubernetes_node) == (
        "kubernetes",
        "engines-a",
        NODE,
    )
    # Outside a pod the runtime reads the kubeconfig, as kubectl does.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "standin", "cluster": {"server": api.url}}],
                "users": [{"name": "agent", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "standin", "user": "agent"}}],
                "current-context": "c",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    runtime = make_runtime(config)
    assert isinstance(runtime, KubernetesRuntime) and runtime.namespace == "engines-a"
    assert runtime.list({}) == []
    assert api.requests[-1][1].startswith("/api/v1/namespaces/engines-a/pods?")


def test_without_its_node_the_kubernetes_runtime_says_which_setting_is_missing(
    tmp_path: Path,
) -> None:
    config = AgentConfig("http://cp", "sxa_x", tmp_path, runtime="kubernetes")
    with pytest.raises(EngineRuntimeError, match="--kubernetes-node or SYSHAX_KUBERNETES_NODE"):
        make_runtime(config)
