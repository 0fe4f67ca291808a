"""The documents' own deployment, for real: vLLM 0.32 in a GPU-role container started first and
a CPU-role container started with ``--ipc container:<gpu>``, the KV cache crossing between them
through the GPU container's /dev/shm (docs/deployment.md, "Two engine containers, tested").

Both engines run the image of images/vllm-cpu (scripts/dev/vllm_image.sh builds it once and caches
it by the hash of its inputs) on Podman's Docker-compatible service, each bound to one core with
1 GiB of KV space, the tiny model and the agent's KV connector mounted read-only:

- the agent's way: the control plane's engine specs for a profile, executed by the agent's
  ``CommandExecutor`` on its Docker runtime, GPU first; a router process on the host forces PD,
  and the PD answer equals the gpu-only answer token for token, with the CPU engine's own
  counter proving it loaded every prompt token from the GPU container's segment;
- bad input: an image without vLLM, and a CPU container whose GPU container is gone, each fail
  the start command with one line naming the cause;
- by hand: the two ``docker run`` lines ``syshax profile render --docker`` prints, run with the
  docker CLI against the same Podman service, give the same answer. Those are containers of
  their own, so this case starts two more engines (after stopping the agent's two).

Each stage's wall time is printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.commands import CommandExecutor
from agents.engine_policy import EnginePolicy
from agents.runtimes import EngineState
from agents.runtimes.dockerapi import DockerRuntime
from common.engine_spec import (
    KV_CONNECTOR_CONTAINER_DIR,
    EngineSpec,
    Mount,
    engine_name,
    kv_connector_dir,
)
from common.supervisor import WaitTimeout, free_port, wait_until
from controlplane.deployments.models import DeploymentProfile
from controlplane.deployments.specs import profile_engine_spec
from testbed.vllm_env import ensure_tiny_model
from tests.realengine.conftest import FORCED_PD, segments, wait_engines_idle
from tests.realengine.test_pd import _body, ask
from tests.router.router_procs import Proc, metric
from tests.support.podman import podman_service
from tests.support.vllm_image import ensure_vllm_image

pytestmark = [pytest.mark.container, pytest.mark.engine, pytest.mark.timeout(1800)]

NODE = "vllm-containers"
DEPLOYMENT = 4101
MODEL_TARGET = "/models/tiny-llama"
ENGINE_COMMAND = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
# The cores of a 2-core machine: the GPU-role engine on 0, the CPU-role engine on 1 (what the
# placement plan gives a deployment here; a profile rendered without a node has no plan).
PLAN = {"gpu_cpuset": "0", "cpuset": "1", "omp_num_threads": 1, "custom_cpu_affinity": "1"}
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1"}


def log(message: str) -> None:
    print(f"[vllm-containers] {message}", flush=True)


@contextmanager
def stage(name: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        log(f"{name}: {time.monotonic() - started:.1f}s")


def profile_fields(name: str, image: str, gpu_port: int, cpu_port: int) -> dict[str, Any]:
    """A vLLM PD profile for the tiny model in the image of images/vllm-cpu, both engines
    bound to one core with 1 GiB of KV space (the bindings in the profile's env, so that a
    render without a node carries them too)."""
    return {
        "name": name,
        "engine": "vllm",
        "pd_protocol": "vllm",
        "model": MODEL_TARGET,
        "served_model_name": "tiny",
        "gpu_image": image,
        "cpu_image": image,
        "gpu_command": ENGINE_COMMAND,
        "cpu_command": ENGINE_COMMAND,
        "gpu_port": gpu_port,
        "cpu_port": cpu_port,
        "max_model_len": 2048,
        "max_num_seqs": 16,
        "cpu_max_num_seqs": 16,
        "gpu_shm_size_gb": 1,
        "kv_arena_mib": 64,
        "cpu_kv_cache_space_gb": 1,
        "gpu_env": {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"},
        "cpu_env": {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "1"},
        "health_timeout_seconds": 600,
    }


def engine_specs(fields: dict[str, Any], deployment_id: int) -> dict[str, dict[str, Any]]:
    """The start commands' specs the control plane sends for ``fields`` (the builder
    ``engine_spec`` and ``syshax profile render`` share), by role."""
    profile = DeploymentProfile(**fields)  # never saved: the specs need no database
    names = (engine_name(deployment_id, 1, "gpu"), engine_name(deployment_id, 1, "cpu"))
    return {
        role: profile_engine_spec(profile, role, node=None, plan=PLAN, names=names).to_dict()
        for role in ("gpu", "cpu")
    }


def start(executor: CommandExecutor, role: str, spec: dict[str, Any], deployment_id: int) -> Any:
    return executor.execute(
        dispatch_id=str(uuid.uuid4()),
        action="start",
        deployment_id=deployment_id,
        generation=1,
        role=role,
        spec=spec,
    )


def engine_metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def healthy(url: str) -> bool:
    with suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=2).status_code == 200
    return False


def start_router(workdir: Path, gpu_url: str, cpu_url: str) -> Proc:
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.json"
    policy.write_text(json.dumps(FORCED_PD))
    return Proc(
        "router",
        [
            "router",
            "--gpu-url", gpu_url,
            "--cpu-url", cpu_url,
            "--model", "tiny",
            "--pd-protocol", "vllm",
            "--policy", str(policy),
            "--log-level", "INFO",
            "--mode-header", "all",
        ],
        workdir,
    )  # fmt: skip


def pd_and_gpu_only(router: Proc, cpu_url: str, *, chat: bool, stream: bool) -> dict[str, Any]:
    """One gpu-only answer and one PD answer through ``router``, checked equal token for token,
    with the KV-use proof: the CPU engine loaded every prompt token through the connector."""
    wait_engines_idle(router, timeout=120)
    hits_before = engine_metric(cpu_url, EXTERNAL_HITS)
    kv_before = metric(router, "syshax_router_kv_transfers_total", outcome="hit")
    gpu_only = ask(router.url, _body(chat, stream), mode="gpu-only")
    pd = ask(router.url, _body(chat, stream))
    injected = engine_metric(cpu_url, EXTERNAL_HITS) - hits_before
    log(
        f"kv-proof api={'chat' if chat else 'completions'} stream={stream} "
        f"prompt_tokens={pd['usage']['prompt_tokens']} injected={injected:g} "
        f"token_ids_equal={pd['ids'] == gpu_only['ids']} ids={pd['ids'][:8]}..."
    )
    assert gpu_only["route"] == "gpu-only" and pd["route"] == "pd"
    assert len(gpu_only["ids"]) == 40
    assert pd["ids"] == gpu_only["ids"]
    assert pd["text"] == gpu_only["text"]
    assert pd["usage"]["prompt_tokens"] == gpu_only["usage"]["prompt_tokens"]
    assert pd["usage"]["completion_tokens"] == gpu_only["usage"]["completion_tokens"] == 40
    assert injected == pd["usage"]["prompt_tokens"]
    assert metric(router, "syshax_router_kv_transfers_total", outcome="hit") == kv_before + 1
    return gpu_only


def dev_shm(pid: int) -> Path:
    """A container process's /dev/shm, seen from the host (no exec into the container)."""
    return Path(f"/proc/{pid}/root/dev/shm")


# ------------------------------------------------------------------ fixtures


@dataclass
class Engine:
    """Podman's service with the vLLM image, and what the tests start on it."""

    env: dict[str, str]  # vllm_image.sh's settings
    sock: Path
    workdir: Path
    model: Path
    image: str
    runtime: DockerRuntime
    made: list[str] = field(default_factory=list)  # container names to remove at the end

    @property
    def docker_host(self) -> str:
        return f"unix://{self.sock}"

    def executor(self, policy: EnginePolicy, name: str) -> CommandExecutor:
        return CommandExecutor(
            self.runtime, node=NODE, state_dir=self.workdir / name, policy=policy
        )

    def policy(self, *images: str) -> EnginePolicy:
        """The policy of an agent started with ``--mount <model>:/models/tiny-llama:ro`` and
        ``--allow-image`` for ``images`` (and the vLLM image)."""
        return EnginePolicy(
            mounts=(Mount(str(self.model), MODEL_TARGET, True),),
            allow_images=(self.image, *images),
        )

    def attrs(self, engine_id: str) -> dict[str, Any]:
        return dict(self.runtime.client.containers.get(engine_id).attrs)

    def remove(self, *names: str) -> None:
        for name in names:  # CPU engines first: they live in a GPU engine's IPC namespace
            with suppress(Exception):
                self.runtime.client.containers.get(name).remove(force=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with stage("image (scripts/dev/vllm_image.sh)"):
        env = ensure_vllm_image()
    model = ensure_tiny_model()
    workdir = Path(tempfile.mkdtemp(prefix="sxv-"))  # short: a unix socket lives in it
    service_env = {k: env[k] for k in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF")}
    try:
        with podman_service(service_env, workdir) as sock:
            runtime = DockerRuntime(
                f"unix://{sock}",
                timeout=120,
                # The agent's --mount: every engine gets the model, read-only.
                default_mounts=(Mount(str(model), MODEL_TARGET, True),),
            )
            found = Engine(env, sock, workdir, model, env["VLLM_CPU_IMAGE"], runtime)
            try:
                yield found
            finally:
                labelled = runtime.list({"syshax.node": NODE})
                cpu_first = sorted(labelled, key=lambda e: e.role != "cpu")
                found.remove(*found.made, *(e.engine_id for e in cpu_first))
                runtime.client.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class Pair:
    executor: CommandExecutor
    gpu: dict[str, Any]  # the start commands' results
    cpu: dict[str, Any]
    gpu_url: str
    cpu_url: str
    router: Proc
    reference: dict[str, Any] = field(default_factory=dict)  # a gpu-only answer

    @property
    def ids(self) -> tuple[str, str]:
        return self.gpu["containers"][0]["engine_id"], self.cpu["containers"][0]["engine_id"]


@pytest.fixture(scope="module")
def pair(engine: Engine) -> Iterator[Pair]:
    """The agent's two engines for one deployment, started once for the module, GPU first,
    and a router on the host in front of them."""
    fields = profile_fields("agent-pair", engine.image, free_port(), free_port())
    specs = engine_specs(fields, DEPLOYMENT)
    executor = engine.executor(engine.policy(), "agent")
    with stage("agent: start the GPU-role container (healthy)"):
        gpu = start(executor, "gpu", specs["gpu"], DEPLOYMENT)
        assert gpu["status"] == "succeeded", gpu["detail"]
    with stage("agent: start the CPU-role container in its IPC namespace (healthy)"):
        cpu = start(executor, "cpu", specs["cpu"], DEPLOYMENT)
        assert cpu["status"] == "succeeded", cpu["detail"]
    router = start_router(
        engine.workdir / "router", gpu["output"]["endpoint"], cpu["output"]["endpoint"]
    )
    try:
        yield Pair(executor, gpu, cpu, gpu["output"]["endpoint"], cpu["output"]["endpoint"], router)
    finally:
        router.stop()
        executor.execute(dispatch_id=str(uuid.uuid4()), action="stop", deployment_id=DEPLOYMENT)


# ------------------------------------------------------------------ the agent's way


def test_the_cpu_container_runs_in_the_gpu_containers_ipc_namespace(
    engine: Engine, pair: Pair
) -> None:
    gpu_id, cpu_id = pair.ids
    gpu, cpu = engine.attrs(gpu_id), engine.attrs(cpu_id)
    assert gpu["HostConfig"]["IpcMode"] == "shareable"
    assert cpu["HostConfig"]["IpcMode"] == f"container:{gpu_id}"
    assert (gpu["HostConfig"]["CpusetCpus"], cpu["HostConfig"]["CpusetCpus"]) == ("0", "1")
    for attrs, bind in ((gpu, "0"), (cpu, "1")):
        assert f"VLLM_CPU_OMP_THREADS_BIND={bind}" in attrs["Config"]["Env"]
        mounts = {m["Destination"]: (m["Source"], m["RW"]) for m in attrs["Mounts"]}
        assert mounts[KV_CONNECTOR_CONTAINER_DIR] == (str(kv_connector_dir()), False)
        assert mounts[MODEL_TARGET] == (str(engine.model), False)
    # One /dev/shm for both (the GPU container's tmpfs), not the host's; the producer's arena
    # lives in it.
    gpu_pid, cpu_pid = gpu["State"]["Pid"], cpu["State"]["Pid"]
    assert os.sched_getaffinity(gpu_pid) == {0} and os.sched_getaffinity(cpu_pid) == {1}
    shared = os.stat(dev_shm(gpu_pid))
    assert (shared.st_dev, shared.st_ino) == (
        os.stat(dev_shm(cpu_pid)).st_dev,
        os.stat(dev_shm(cpu_pid)).st_ino,
    )
    assert shared.st_dev != os.stat("/dev/shm").st_dev
    names = sorted(p.name for p in dev_shm(gpu_pid).iterdir())
    assert names == sorted(p.name for p in dev_shm(cpu_pid).iterdir())
    assert any(name.startswith("syshax-") for name in names), names


@pytest.mark.parametrize(
    ("chat", "stream"), [(False, False), (True, True)], ids=["completions-json", "chat-stream"]
)
def test_pd_across_the_two_containers_equals_gpu_only_token_for_token(
    engine: Engine, pair: Pair, chat: bool, stream: bool
) -> None:
    with stage(f"PD vs gpu-only ({'chat' if chat else 'completions'}, stream={stream})"):
        answer = pd_and_gpu_only(pair.router, pair.cpu_url, chat=chat, stream=stream)
    if not chat and not stream:
        pair.reference.update(answer)
    gpu_pid = engine.attrs(pair.ids[0])["State"]["Pid"]
    assert not segments(dev_shm(gpu_pid)), "the segment is released once loaded"


# ------------------------------------------------------------------ bad input


def test_an_image_without_vllm_fails_the_start_with_one_line_naming_the_cause(
    engine: Engine,
) -> None:
    """The Debian base image has python3 but no vLLM: the engine exits at once, and the
    command's detail says so in its first part."""
    base = engine.env["SYSHAX_BASE_IMAGE"]
    deployment = DEPLOYMENT + 1
    fields = profile_fields("no-vllm", base, free_port(), free_port())
    spec = engine_specs(fields, deployment)["gpu"]
    executor = engine.executor(engine.policy(base), "no-vllm")
    with stage("bad input: an image without vLLM"):
        result = start(executor, "gpu", spec, deployment)
    log(f"detail: {result['detail'][:300]}")
    assert result["status"] == "failed"
    cause, where, *_ = result["detail"].split(" | ")
    # The code shows when the agent caught the container between two of its restarts (the
    # profile's engines restart unless stopped; Podman restarts them at once).
    assert re.fullmatch(
        r"GPU engine exited( with code 1)?: /usr/bin/python3: Error while finding module "
        r"specification for 'vllm\.entrypoints\.openai\.api_server' "
        r"\(ModuleNotFoundError: No module named 'vllm'\)",
        cause,
    ), cause
    assert where.startswith(f"full log: {NODE}:")
    assert engine.runtime.list({"syshax.deployment": str(deployment)}) == []


class GpuGoneBeforeTheCpuJoins(DockerRuntime):
    """The agent's Docker runtime, with the GPU engine's container removed between the agent's
    look (it was running) and the CPU container's create: what ``docker rm -f`` by hand or the
    OOM killer does at the wrong moment, which the executor's own check cannot see."""

    def start(
        self, name: str, spec: EngineSpec, labels: Any, ipc_peer: EngineState | None
    ) -> EngineState:
        if ipc_peer is not None:
            self.client.containers.get(ipc_peer.engine_id).remove(force=True)
        return super().start(name, spec, labels, ipc_peer)


def test_a_cpu_container_that_cannot_join_the_gpu_ipc_namespace_fails_with_one_line(
    engine: Engine, tmp_path: Path
) -> None:
    deployment = DEPLOYMENT + 2
    www = tmp_path / "www"
    (www / "v1").mkdir(parents=True)
    (www / "health").write_text("ok")
    (www / "v1" / "models").write_text('{"data": [{"id": "tiny"}]}')
    # A stand-in GPU engine that is healthy at once: the image's python serving /health.
    port = free_port()
    standin = {
        "image": engine.image,
        "command": ["python3", "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        "working_dir": "/srv/www",
        "port": port,
        "ipc": "shareable",
        "shm_size_bytes": 64 << 20,
        "restart_policy": "no",
        "health_timeout_seconds": 60,
        "mounts": [{"source": str(www), "target": "/srv/www", "read_only": True}],
    }
    fields = profile_fields("ipc-gone", engine.image, free_port(), free_port())
    cpu_spec = engine_specs(fields, deployment)["cpu"]
    runtime = GpuGoneBeforeTheCpuJoins(
        engine.docker_host, default_mounts=engine.runtime.default_mounts
    )
    # The stand-in is no engine entry point: this agent runs any (mounts are still checked).
    policy = EnginePolicy(
        mounts=(Mount(str(www), "/srv/www", True), Mount(str(engine.model), MODEL_TARGET, True)),
        allow_any_engine=True,
    )
    executor = CommandExecutor(runtime, node=NODE, state_dir=tmp_path / "agent", policy=policy)
    try:
        with stage("bad input: the GPU container gone when the CPU container joins"):
            gpu = start(executor, "gpu", standin, deployment)
            assert gpu["status"] == "succeeded", gpu["detail"]
            result = start(executor, "cpu", cpu_spec, deployment)
        log(f"detail: {result['detail'][:300]}")
        assert result["status"] == "failed"
        assert "\n" not in result["detail"]
        gpu_name, cpu_name = (engine_name(deployment, 1, r) for r in ("gpu", "cpu"))
        assert result["detail"].startswith(
            f"container engine refused {cpu_name}: the CPU engine cannot join the IPC "
            f"namespace of GPU engine {gpu_name}: "
        )
        assert "no such container" in result["detail"]
        assert runtime.list({"syshax.deployment": str(deployment)}) == []
    finally:
        runtime.client.close()


# ------------------------------------------------------------------ by hand


def rendered_lines(text: str) -> list[list[str]]:
    """Each command of ``syshax profile render`` as its argv (comments dropped)."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return [shlex.split(cmd) for cmd in body.replace("\\\n", " ").splitlines() if cmd.strip()]


def docker_cli(engine: Engine) -> tuple[list[str], dict[str, str]]:
    """The docker CLI on Podman's service (the agent's engine, its storage); else podman's own
    CLI on the same storage."""
    docker = shutil.which("docker")
    if docker:
        return [docker], {**os.environ, "DOCKER_HOST": engine.docker_host}
    env = {k: engine.env[k] for k in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF")}
    return ["podman"], {**os.environ, **env}


def render_docker(fields: dict[str, Any], workdir: Path) -> str:
    """``syshax profile render NAME --docker`` as an operator runs it: the ``syshax`` command on
    a control plane of its own (SQLite in ``workdir``) where the profile was created."""
    env = {
        **os.environ,
        "SYSHAX_VAR_DIR": str(workdir / "var"),
        "SYSHAX_ENV_FILE": str(workdir / "none.env"),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
        "DATABASE_URL": "",  # the suite's may name PostgreSQL: this control plane is SQLite
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
    }
    create = (
        "import json, sys\n"
        "from controlplane.deployments.models import DeploymentProfile\n"
        "DeploymentProfile.objects.create(**json.loads(sys.stdin.read()))"
    )
    steps = (
        (["manage", "migrate", "--verbosity", "0"], None),
        (["manage", "shell", "-c", create], json.dumps(fields)),
        (["profile", "render", fields["name"], "--docker"], None),
    )
    out = ""
    for args, given in steps:
        done = subprocess.run(
            [sys.executable, "-m", "syshax.cli", *args],
            input=given,
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"syshax {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        out = done.stdout
    return out


def test_the_rendered_docker_run_lines_run_by_hand_give_the_same_answer(
    engine: Engine, pair: Pair, tmp_path: Path
) -> None:
    """Last in the module: it stops the agent's engines."""
    name = f"by-hand-{secrets.token_hex(3)}"
    gpu_port, cpu_port = free_port(), free_port()
    with stage("by hand: syshax profile render --docker"):
        rendered = render_docker(profile_fields(name, engine.image, gpu_port, cpu_port), tmp_path)
    log("rendered:\n" + rendered)
    gpu_line, cpu_line = rendered_lines(rendered)
    gpu_name, cpu_name = f"syshax-{name}-gpu", f"syshax-{name}-cpu"
    assert gpu_line[:2] == cpu_line[:2] == ["docker", "run"]
    assert cpu_line[cpu_line.index("--ipc") + 1] == f"container:{gpu_name}"

    # The agent's two engines go first: two cores, and this case is about two new ones.
    reference = dict(pair.reference) or ask(pair.router.url, _body(False, False), "gpu-only")
    stopped = pair.executor.execute(
        dispatch_id=str(uuid.uuid4()), action="stop", deployment_id=DEPLOYMENT
    )
    assert stopped["output"]["stopped"] == [engine_name(DEPLOYMENT, 1, r) for r in ("cpu", "gpu")]

    cli, env = docker_cli(engine)
    engine.made += [cpu_name, gpu_name]
    log(f"running the lines with {cli[0]} ({env.get('DOCKER_HOST', 'podman storage')})")
    router = None
    try:
        with stage("by hand: docker run GPU, then CPU; both healthy"):
            for line in (gpu_line, cpu_line):
                # The model is the agent's --mount, node configuration the profile does not
                # carry: an operator adds it the same way, before the image.
                at = line.index(engine.image)
                argv = [*cli, *line[1:at]]
                argv += [
                    "--mount",
                    f"type=bind,source={engine.model},target={MODEL_TARGET},readonly",
                ]
                argv += line[at:]
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, done.stderr
            gpu_url, cpu_url = f"http://127.0.0.1:{gpu_port}", f"http://127.0.0.1:{cpu_port}"
            for url, container in ((gpu_url, gpu_name), (cpu_url, cpu_name)):

                def up(url: str = url, container: str = container) -> bool:
                    state = engine.attrs(container)["State"]
                    assert state["Status"] == "running", engine.runtime.logs(container, 40)
                    return healthy(url)

                try:
                    wait_until(up, 600, f"{container} healthy", interval=2)
                except WaitTimeout as exc:
                    raise AssertionError(f"{exc}:\n{engine.runtime.logs(container, 40)}") from None
        router = start_router(tmp_path / "router", gpu_url, cpu_url)
        gpu_id = engine.attrs(gpu_name)["Id"]
        assert engine.attrs(cpu_name)["HostConfig"]["IpcMode"] == f"container:{gpu_id}"
        with stage("by hand: PD vs gpu-only"):
            answer = pd_and_gpu_only(router, cpu_url, chat=False, stream=False)
        assert answer["ids"] == reference["ids"], "the agent's containers answered the same"
    finally:
        if router is not None:
            router.stop()
        engine.remove(cpu_name, gpu_name)
