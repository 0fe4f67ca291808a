"""A real agent process against the real control plane: web (gunicorn), Celery worker, the
test database and broker. Discovery, heartbeats, a hetero deploy/stop with the process
runtime, offline detection and recovery, and a kill of agent and worker in mid-deploy.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_helpers import IMAGE, free_port, host_mounts
from django.contrib.auth.models import User
from django.db import connections

from agents.runtimes.dockerapi import DockerRuntime
from agents.runtimes.process import ProcessRuntime
from controlplane.access.models import MachineCredential
from controlplane.deployments import services
from controlplane.deployments.models import AgentCommand, Deployment, DeploymentProfile
from controlplane.deployments.workflow import expire_stale_commands
from controlplane.inventory.models import Node
from controlplane.inventory.services import mark_lost_nodes
from tests.support.controlplane import child_env, running, syshax, wait_until

pytestmark = [pytest.mark.process, pytest.mark.django_db(transaction=True)]

INTERVAL = 0.5  # heartbeat period for these tests; grace = 3 x


class Fleet:
    """The processes of one test: web, worker and the agent, each restartable."""

    def __init__(self, tmp: Path, stack: ExitStack) -> None:
        self.tmp = tmp
        self.stack = stack
        self.env = child_env(HEARTBEAT_INTERVAL_SECONDS=str(INTERVAL), HEARTBEAT_TOLERANCE="3")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, Any] = {}
        self.token = ""
        self.runs = 0

    def start(self, name: str, argv: list[str]) -> None:
        self.runs += 1
        ctx = running(argv, self.tmp / f"{name}-{self.runs}.log", self.env)
        self.procs[name] = (ctx, ctx.__enter__())

    def kill(self, name: str) -> None:
        ctx, proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        ctx.__exit__(None, None, None)

    def stop_all(self) -> None:
        for name in list(self.procs):
            ctx, _ = self.procs.pop(name)
            ctx.__exit__(None, None, None)

    def web(self) -> None:
        self.start(
            "web",
            syshax(
                "web",
                "--bind",
                f"127.0.0.1:{self.port}",
                "--workers",
                "1",
                "--threads",
                "4",
                "--no-migrate",
            ),
        )
        wait_until(lambda: _answers(self.url + "/api/v1/health"), 60, "the web app")

    def worker(self) -> None:
        self.start("worker", syshax("worker", "--concurrency", "1"))

    def agent(self, *extra: str) -> None:
        self.start(
            "agent",
            [
                sys.executable,
                "-m",
                "syshax.cli",
                "agent",
                "--control-plane",
                self.url,
                "--token",
                self.token,
                "--runtime",
                "process",
                "--state-dir",
                str(self.tmp / "agent-state"),
                "--simulate-accelerator",
                "a100-80gb",
                *extra,
            ],
        )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.fixture
def fleet(tmp_path: Path, settings: Any) -> Iterator[Fleet]:
    settings.HEARTBEAT_INTERVAL_SECONDS = INTERVAL  # the reaper's grace in this process
    settings.HEARTBEAT_TOLERANCE = 3.0
    with ExitStack() as stack:
        f = Fleet(tmp_path, stack)
        try:
            yield f
        finally:
            f.stop_all()
            runtime = ProcessRuntime(tmp_path / "agent-state")
            for engine in sorted(runtime.list({}), key=lambda e: e.role != "cpu"):
                runtime.stop(engine.engine_id, timeout=3)


def make_profile(name: str, health_timeout: float = 60) -> DeploymentProfile:
    sim = [sys.executable, "-m", "syshax.cli", "sim"]
    return DeploymentProfile.objects.create(
        name=name,
        model="qwen2.5-7b-instruct",
        engine="simulator",
        sim_gpu_device="a100-80gb",
        sim_cpu_device="xeon-8480",
        quantization="none",
        gpu_command=sim,
        cpu_command=sim,
        gpu_port=free_port(),
        cpu_port=free_port(),
        gpu_extra_args=["--speed", "50"],
        cpu_extra_args=["--speed", "50"],
        max_model_len=4096,
        health_timeout_seconds=health_timeout,
    )


def register(fleet: Fleet, name: str) -> Node:
    node = Node.objects.create(name=name, address="127.0.0.1")
    fleet.token = MachineCredential.issue("agent", f"agent-{name}", node=node)[1]
    connections.close_all()
    return node


def deployment_state(pk: int) -> str:
    return str(Deployment.objects.get(pk=pk).state)


def engines(fleet: Fleet) -> list[tuple[str, int]]:
    runtime = ProcessRuntime(fleet.tmp / "agent-state")
    return sorted((e.role, e.generation) for e in runtime.list({}) if e.status == "running")


def test_discovery_heartbeats_deploy_offline_recovery_and_stop(fleet: Fleet) -> None:
    node = register(fleet, "e2e-a")
    admin = User.objects.create_superuser("e2e-admin", "a@example.com", "x")
    fleet.web()
    fleet.worker()
    fleet.agent()

    # Discovery and heartbeats: the inventory lands in the rows, the node comes online.
    wait_until(lambda: Node.objects.get(pk=node.pk).status == "online", 60, "node online")
    node.refresh_from_db()
    (card,) = node.accelerators.all()
    assert card.simulated and card.model_name == "A100-SXM4-80GB"
    assert node.cpu.physical_cores >= 1  # type: ignore[attr-defined]
    first_beat = node.last_heartbeat_at
    wait_until(
        lambda: Node.objects.get(pk=node.pk).last_heartbeat_at != first_beat,
        10,
        "a second heartbeat",
    )

    # A hetero deploy with the process runtime: GPU engine healthy before the CPU one starts.
    deployment = services.create_deployment(
        name="e2e-hetero", profile=make_profile("e2e-p"), node=node, acting_user=admin
    )
    began = time.monotonic()
    services.request_deploy(deployment, acting_user=admin)
    wait_until(lambda: deployment_state(deployment.pk) in ("running", "failed"), 120, "deploy")
    deploy_seconds = time.monotonic() - began
    deployment.refresh_from_db()
    assert deployment.state == "running", deployment.state_reason
    commands = {c.step: c for c in AgentCommand.objects.filter(deployment=deployment)}
    gpu_done = commands["start-gpu"].completed_at
    assert gpu_done is not None and gpu_done <= commands["start-cpu"].created_at
    assert engines(fleet) == [("cpu", 1), ("gpu", 1)]
    for url in (deployment.gpu_endpoint, deployment.cpu_endpoint):
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
    print(f"\ndeploy of a hetero profile, end to end: {deploy_seconds:.2f} s")

    # The agent dies: no heartbeats for the grace period -> offline, deployment unknown,
    # engines untouched.
    fleet.kill("agent")
    wait_until(lambda: node.pk in mark_lost_nodes(), 30, "the reaper to mark the node offline")
    assert Node.objects.get(pk=node.pk).status == "offline"
    assert deployment_state(deployment.pk) == "unknown"
    assert httpx.get(deployment.gpu_endpoint + "/health", timeout=5).status_code == 200

    # It comes back without re-registering, re-adopts its engines, and the deployment recovers.
    fleet.agent()
    wait_until(lambda: Node.objects.get(pk=node.pk).status == "online", 30, "node back")
    wait_until(lambda: deployment_state(deployment.pk) == "running", 30, "deployment back")
    assert engines(fleet) == [("cpu", 1), ("gpu", 1)]  # nothing started twice

    services.request_stop(Deployment.objects.get(pk=deployment.pk), acting_user=admin)
    wait_until(lambda: deployment_state(deployment.pk) in ("stopped", "failed"), 60, "stop")
    assert deployment_state(deployment.pk) == "stopped"
    assert engines(fleet) == []


def test_killing_agent_and_worker_mid_deploy_loses_and_duplicates_nothing(
    fleet: Fleet,
) -> None:
    node = register(fleet, "e2e-b")
    admin = User.objects.create_superuser("e2e-admin-b", "b@example.com", "x")
    fleet.web()
    fleet.worker()
    fleet.agent()
    wait_until(lambda: Node.objects.get(pk=node.pk).status == "online", 60, "node online")
    deployment = services.create_deployment(
        name="e2e-crash",
        profile=make_profile("e2e-q", health_timeout=8),
        node=node,
        acting_user=admin,
    )
    services.request_deploy(deployment, acting_user=admin)

    # Kill both the moment the GPU engine's start is in flight.
    wait_until(
        lambda: AgentCommand.objects.filter(deployment=deployment, step="start-gpu").exists(),
        60,
        "start-gpu dispatched",
    )
    fleet.kill("agent")
    fleet.kill("worker")
    time.sleep(1.0)
    fleet.worker()
    fleet.agent()

    def settled() -> bool:
        # What beat does every 30 s in production, sped up: offer again what got no result.
        # The restarted agent is a new session, so it is handed the start-gpu command anyway.
        expire_stale_commands(older_than_seconds=2.0)
        return deployment_state(deployment.pk) in ("running", "failed")

    wait_until(settled, 150, "the deploy to finish after the crash", interval=1.0)
    deployment.refresh_from_db()
    assert deployment.state == "running", deployment.state_reason
    steps = list(AgentCommand.objects.filter(deployment=deployment).values_list("step", flat=True))
    assert sorted(steps) == sorted(set(steps))  # one command per step, however often re-sent
    assert engines(fleet) == [("cpu", 1), ("gpu", 1)]  # and one engine per role
    gpu = AgentCommand.objects.get(deployment=deployment, step="start-gpu")
    print(f"\nstart-gpu: attempts={gpu.attempts} adopted={gpu.output.get('adopted')}")
    services.request_stop(Deployment.objects.get(pk=deployment.pk), acting_user=admin)
    wait_until(lambda: deployment_state(deployment.pk) == "stopped", 60, "stop")
    assert engines(fleet) == []


def test_the_same_deploy_and_stop_on_podmans_docker_api_starts_gpu_healthy_before_cpu(
    fleet: Fleet, podman_service: dict[str, str]
) -> None:
    node = register(fleet, "e2e-podman")
    admin = User.objects.create_superuser("e2e-admin-c", "c@example.com", "x")
    runtime = DockerRuntime(podman_service["DOCKER_HOST"])
    mounts = [f"{m['source']}:{m['target']}:ro" for m in host_mounts()]
    fleet.web()
    fleet.worker()
    fleet.agent(
        "--runtime",
        "docker",
        "--docker-url",
        podman_service["DOCKER_HOST"],
        *(arg for m in mounts for arg in ("--mount", m)),
        "--allow-image",
        IMAGE,
    )
    try:
        wait_until(lambda: Node.objects.get(pk=node.pk).status == "online", 60, "node online")
        profile = make_profile("e2e-podman-p")
        profile.gpu_image = profile.cpu_image = IMAGE
        profile.save()
        deployment = services.create_deployment(
            name="e2e-podman", profile=profile, node=node, acting_user=admin
        )
        began = time.monotonic()
        services.request_deploy(deployment, acting_user=admin)
        wait_until(
            lambda: deployment_state(deployment.pk) in ("running", "failed"),
            120,
            "deploy on podman",
        )
        print(f"\ndeploy on Podman, end to end: {time.monotonic() - began:.2f} s")
        deployment.refresh_from_db()
        assert deployment.state == "running", deployment.state_reason

        mine = {"syshax.node": "e2e-podman"}
        containers = {
            e.role: runtime.client.containers.get(e.engine_id) for e in runtime.list(mine)
        }
        assert set(containers) == {"gpu", "cpu"}
        gpu, cpu = containers["gpu"], containers["cpu"]
        assert cpu.attrs["HostConfig"]["IpcMode"] == f"container:{gpu.id}"
        assert gpu.attrs["HostConfig"]["IpcMode"] == "shareable"
        assert gpu.attrs["HostConfig"]["ShmSize"] > 0
        # Start order: the CPU container was created only after the agent reported the GPU
        # engine healthy (the start-gpu command's completion).
        start_gpu = AgentCommand.objects.get(deployment=deployment, step="start-gpu")
        start_cpu = AgentCommand.objects.get(deployment=deployment, step="start-cpu")
        assert cpu.labels["syshax.dispatch"] == str(start_cpu.dispatch_id)
        assert start_gpu.output["startup_seconds"] > 0
        assert start_gpu.completed_at is not None
        assert _created(cpu) >= start_gpu.completed_at - timedelta(seconds=0.5)
        assert _created(cpu) > _created(gpu)
        for url in (deployment.gpu_endpoint, deployment.cpu_endpoint):
            assert httpx.get(url + "/v1/models", timeout=5).status_code == 200

        services.request_stop(Deployment.objects.get(pk=deployment.pk), acting_user=admin)
        wait_until(lambda: deployment_state(deployment.pk) in ("stopped", "failed"), 60, "stop")
        assert deployment_state(deployment.pk) == "stopped"
        assert runtime.list(mine) == []
    finally:
        for engine in sorted(
            runtime.list({"syshax.node": "e2e-podman"}), key=lambda e: e.role != "cpu"
        ):
            runtime.stop(engine.engine_id, timeout=2)
        runtime.client.close()


def _created(container: Any) -> datetime:
    """A container's creation time (Docker and Podman give RFC 3339 with nanoseconds)."""
    raw = str(container.attrs["Created"])
    head, _, rest = raw.partition(".")
    frac = "".join(ch for ch in rest if ch.isdigit())[:6]
    tz = rest[len("".join(ch for ch in rest if ch.isdigit())) :] or "Z"
    stamp = datetime.fromisoformat(f"{head}.{frac or '0'}{'+00:00' if tz == 'Z' else tz}")
    return stamp.astimezone(UTC)
