"""docker-compose.yml for real: the whole stack on a Docker-API engine (Podman's service).

scripts/dev/compose_setup.sh installs Podman and docker-compose from Debian packages and builds
the images no registry can give us here (a debootstrapped Debian base, stand-ins for postgres
and redis). This test starts its own `podman system service` on a private socket, builds the
project image, brings the stack up in the order docs/deployment.md gives, issues the tokens
the way it says, deploys simulated engines through the REST API, serves completions through
the router container with the `openai` client, restarts Redis and web, and checks the stack
recovers. Each stage's duration is printed.

Podman without systemd (as here) does not run health checks on its own; `HealthChecks` below
runs them (`podman healthcheck run`), as Docker's daemon would.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.support.podman import podman_service

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "dev" / "compose_setup.sh"
IMAGE = "syshax-controlplane:latest"
MODEL = "deepseek-r1-distill-qwen-32b"
CONTROL_PLANE = ("postgres", "redis", "web", "gateway", "worker", "benchmarks", "beat")

pytestmark = [pytest.mark.container, pytest.mark.timeout(2700)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broken(AssertionError):
    """A failure waiting cannot cure (a service unhealthy, a deployment failed)."""


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    """``check()``'s first truthy answer; exceptions other than Broken count as "not yet"."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            answer = check()
            if answer:
                return answer
            last = answer
        except Broken:
            raise
        except Exception as exc:  # the service is still coming up
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def rfc3339(stamp: str) -> str:
    """Podman's time stamps cut to microseconds and UTC, comparable as strings."""
    if not stamp:
        return ""
    moment = datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", stamp.replace("Z", "+00:00")))
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")


class Stages:
    """Wall-clock time of each stage, printed as it ends and as a table at the end."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []
        self.started = time.monotonic()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.times.append((name, took))
            print(f"[compose-up] {name}: {took:.1f}s", flush=True)

    def report(self) -> None:
        total = time.monotonic() - self.started
        width = max((len(name) for name, _ in self.times), default=5)
        print("\n[compose-up] stage timings")
        for name, took in self.times:
            print(f"  {name.ljust(width)}  {took:7.1f}s")
        print(f"  {'total'.ljust(width)}  {total:7.1f}s", flush=True)


class Podman:
    """The podman CLI on the private storage and configuration of compose_setup.sh."""

    def __init__(self, env_vars: dict[str, str]) -> None:
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": env_vars["CONTAINERS_CONF"],
            "CONTAINERS_STORAGE_CONF": env_vars["CONTAINERS_STORAGE_CONF"],
        }

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        result = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def ids(self, *filters: str, all_: bool = False) -> list[str]:
        args = ["ps", "-q", "--no-trunc"] + (["-a"] if all_ else [])
        for f in filters:
            args += ["--filter", f"label={f}"]
        return self.run(*args).split()

    def inspect(self, ids: list[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        out = self.run("inspect", *ids, check=False)
        return list(json.loads(out)) if out.strip() else []


class HealthChecks(threading.Thread):
    """Run the containers' health checks, as Docker's daemon (or Podman with systemd) does.

    A container still ``starting`` is checked every interval/5 (at least 2 s), a settled one
    every interval; at most one check per container is in flight.
    """

    def __init__(self, podman: Podman, project: str) -> None:
        super().__init__(name="healthchecks", daemon=True)
        self.podman = podman
        self.project = project
        self.stop_event = threading.Event()
        self.due: dict[str, float] = {}
        self.running: set[str] = set()
        self.lock = threading.Lock()

    def check(self, cid: str, timeout: float) -> None:
        try:
            self.podman.run("healthcheck", "run", cid, timeout=timeout + 15, check=False)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with self.lock:
                self.running.discard(cid)

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            try:
                containers = self.podman.inspect(
                    self.podman.ids(f"com.docker.compose.project={self.project}")
                )
            except Exception:  # the service restarting, a container going away
                continue
            now = time.monotonic()
            for info in containers:
                config = (info.get("Config") or {}).get("Healthcheck") or {}
                if not config.get("Test") or config["Test"][0] == "NONE":
                    continue
                cid = str(info["Id"])
                interval = (config.get("Interval") or 30e9) / 1e9
                timeout = (config.get("Timeout") or 30e9) / 1e9
                status = ((info.get("State") or {}).get("Health") or {}).get("Status")
                period = interval if status == "healthy" else max(2.0, interval / 5)
                with self.lock:
                    if cid in self.running or self.due.get(cid, 0) > now:
                        continue
                    self.running.add(cid)
                    self.due[cid] = now + period
                threading.Thread(target=self.check, args=(cid, timeout), daemon=True).start()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)


class Compose:
    """docker-compose on the project's file (plus the test's override) against our service."""

    def __init__(self, client: str, env_file: Path, override: Path, project: str, sock: Path):
        self.base = [
            client,
            "--project-name",
            project,
            "--env-file",
            str(env_file),
            "-f",
            str(ROOT / "docker-compose.yml"),
            "-f",
            str(override),
        ]
        # Only what the client needs: compose lets the caller's environment override the
        # env file, and the test suite's environment holds DATABASE_URL, REDIS_URL and more.
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "DOCKER_HOST": f"unix://{sock}",
            "COMPOSE_DOCKER_CLI_BUILD": "0",
            "COMPOSE_INTERACTIVE_NO_CLI": "1",
        }

    def __call__(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run(
            [*self.base, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise AssertionError(
                f"docker-compose {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result.stdout


def setup_engine() -> dict[str, str]:
    """Run compose_setup.sh; skip only where the engine cannot be installed and skips are
    allowed (SYSHAX_FORBID_SKIPS is not 1)."""
    if shutil.which("apt-get") is None:
        missing = "no apt-get: Podman cannot be installed here"
        if os.environ.get("SYSHAX_FORBID_SKIPS") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    setup = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, timeout=1800, env=os.environ
    )
    if setup.returncode == 3 and os.environ.get("SYSHAX_FORBID_SKIPS") != "1":
        pytest.skip(f"Podman cannot be installed here: {setup.stderr.strip()[-500:]}")
    assert setup.returncode == 0, f"compose setup failed:\n{setup.stdout}\n{setup.stderr}"
    return dict(line.split("=", 1) for line in setup.stdout.splitlines() if "=" in line)


def stop_conmon_of(container_ids: set[str]) -> None:
    """Exec sessions through the API keep their conmon for minutes after the container is
    gone (``--exit-delay``); end those of this test's containers, by their pid."""
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["name"] != "conmon" or "-c" not in cmdline:
            continue
        index = cmdline.index("-c") + 1
        if index < len(cmdline) and cmdline[index] in container_ids:
            with suppress(psutil.Error):
                proc.terminate()


def write_env(path: Path, values: dict[str, str]) -> None:
    path.write_text("".join(f"{key}={value}\n" for key, value in values.items()))


def agent_override(path: Path) -> None:
    """The agent of docker-compose.yml on a simulated card: this machine has no GPU, and a
    deployment needs an accelerator to be placed (a CPU-only box deploys simulators so)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = [*compose["services"]["agent"]["command"], "--simulate-accelerator", "a100-80gb"]
    path.write_text(yaml.safe_dump({"services": {"agent": {"command": command}}}))


def completion(router_port: int, prompt: str, api_key: str) -> Any:
    from openai import OpenAI

    client = OpenAI(
        base_url=f"http://127.0.0.1:{router_port}/v1", api_key=api_key, timeout=30, max_retries=0
    )
    try:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    finally:
        client.close()


def test_compose_brings_the_stack_up_serves_completions_and_recovers() -> None:
    stages = Stages()
    with ExitStack() as stack:
        stack.callback(stages.report)
        with stages.stage("setup (packages, storage, base images)"):
            env_vars = setup_engine()
        print(
            f"[compose-up] storage driver {env_vars['SYSHAX_COMPOSE_STORAGE_DRIVER']}, "
            f"client {env_vars['COMPOSE']}",
            flush=True,
        )
        podman = Podman(env_vars)
        workdir = Path(tempfile.mkdtemp(prefix="sxc-"))  # short: a unix socket lives in it
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        with stages.stage("podman system service"):
            sock = stack.enter_context(podman_service(env_vars, workdir))

        project = f"syshaxtest{secrets.token_hex(4)}"
        node_name = f"compose-{secrets.token_hex(3)}"
        web_port, gateway_port, router_port, gpu_port, cpu_port = (free_port() for _ in range(5))
        env_file = workdir / "compose.env"
        env: dict[str, str] = {
            "SECRET_KEY": secrets.token_urlsafe(60),
            "POSTGRES_PASSWORD": secrets.token_hex(16),
            "ALLOWED_HOSTS": "web,localhost,127.0.0.1",
            "SECURE_SSL_REDIRECT": "false",
            "APP_ENV_FILE": str(env_file),
            "SYSHAX_BASE_IMAGE": env_vars["SYSHAX_BASE_IMAGE"],
            "POSTGRES_IMAGE": env_vars["POSTGRES_IMAGE"],
            "REDIS_IMAGE": env_vars["REDIS_IMAGE"],
            "DOCKER_SOCKET": str(sock),
            "WEB_PORT": str(web_port),
            "GATEWAY_PORT": str(gateway_port),
            "ROUTER_PORT": str(router_port),
            "WEB_WORKERS": "2",
            "WORKER_CONCURRENCY": "2",
            "ROUTER_API_KEY": "sxk_" + secrets.token_urlsafe(32),
            "ROUTER_BENCHMARK_KEY": "sxk_" + secrets.token_urlsafe(32),
            "ROUTER_TOKEN": "",
            "ROUTER_NAME": f"router-{project}",
            "AGENT_TOKEN": "",
            "NODE_NAME": node_name,
            "HEARTBEAT_INTERVAL_SECONDS": "5",
            "HEARTBEAT_TOLERANCE": "3",
        }
        write_env(env_file, env)
        override = workdir / "agent-override.yml"
        agent_override(override)
        compose = Compose(env_vars["COMPOSE"], env_file, override, project, sock)
        seen: set[str] = set()  # every container of the project, for the conmon clean-up

        def teardown() -> None:
            with stages.stage("teardown (down -v, engines, network)"):
                remove_everything()

        def remove_everything() -> None:
            seen.update(podman.ids(f"com.docker.compose.project={project}", all_=True))
            try:
                compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180)
            finally:
                # Engines the agent started: CPU first, its IPC namespace is the GPU engine's.
                for role in ("cpu", "gpu", None):
                    labels = [f"syshax.node={node_name}"] + (
                        [f"syshax.role={role}"] if role else []
                    )
                    engines = podman.ids(*labels, all_=True)
                    seen.update(engines)
                    if engines:
                        podman.run("rm", "-f", "-t", "2", *engines, check=False)
                podman.run("network", "rm", "-f", f"{project}_default", check=False)
                stop_conmon_of(seen)
                # Project images that a newer build replaced (untagged, nothing built on them).
                podman.run("image", "prune", "-f", check=False)

        def diagnostics() -> None:
            ids = podman.ids(f"com.docker.compose.project={project}", all_=True)
            for info in podman.inspect(ids + podman.ids(f"syshax.node={node_name}", all_=True)):
                health = (info.get("State") or {}).get("Health") or {}
                checks = [
                    f"  check exit {c.get('ExitCode')}: {str(c.get('Output', ''))[-300:]}"
                    for c in (health.get("Log") or [])[-3:]
                ]
                logs = subprocess.run(
                    ["podman", "logs", "--tail", "40", info["Id"]],
                    env=podman.env,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                print(
                    f"\n----- {info['Name']} ({health.get('Status', '-')})\n"
                    + "\n".join(checks)
                    + f"\n{logs.stdout}{logs.stderr}"
                )
            print((workdir / "service.log").read_text()[-3000:])

        stack.callback(teardown)
        checks = HealthChecks(podman, project)
        checks.start()
        stack.callback(checks.stop)

        def health(since: str = "") -> dict[str, str]:
            out: dict[str, str] = {}
            ids = podman.ids(f"com.docker.compose.project={project}", all_=True)
            for info in podman.inspect(ids):
                service = info["Config"]["Labels"]["com.docker.compose.service"]
                state = info.get("State") or {}
                checks = (state.get("Health") or {}).get("Log") or [{}]
                if since and (
                    rfc3339(state.get("StartedAt", "")) < since
                    or rfc3339(checks[-1].get("Start", "")) < since
                ):
                    out[service] = "not restarted"
                    continue
                out[service] = (state.get("Health") or {}).get("Status") or state.get("Status")
            return out

        def all_healthy(services: tuple[str, ...], since: str = "") -> Callable[[], bool]:
            """Every one of ``services`` healthy (and, with ``since``, started and checked
            after that RFC 3339 time, so a status from before a restart does not count)."""

            def check() -> bool:
                status = health(since)
                if any(status.get(s) == "unhealthy" for s in services):
                    raise Broken(f"unhealthy: {status}")
                return all(status.get(s) == "healthy" for s in services)

            return check

        try:
            with stages.stage("build the project image"):
                compose("build", "--force-rm", "web", timeout=1800)
            with stages.stage("up postgres redis web gateway worker benchmarks beat (healthy)"):
                compose("up", "-d", *CONTROL_PLANE, timeout=600)
                wait_for(all_healthy(CONTROL_PLANE), 300, "the control plane's health checks")

            with stages.stage("issue the admin, agent and router tokens"):
                password = secrets.token_urlsafe(16)
                compose(
                    "exec", "-T", "-e", f"DJANGO_SUPERUSER_PASSWORD={password}", "web",
                    "syshax", "manage", "createsuperuser", "--noinput",
                    "--username", "admin", "--email", "admin@example.com",
                )  # fmt: skip
                out = compose("exec", "-T", "web", "syshax", "manage", "issue_token", "admin")
                # The token is alone on its (stdout) line; `compose exec` interleaves stderr.
                (admin_token,) = [line for line in out.splitlines() if line.startswith("sxp_")]
                # The snippet of docs/deployment.md.
                out = compose(
                    "exec", "-T", "web", "syshax", "manage", "shell", "-c",
                    "from controlplane.inventory.models import Node\n"
                    "from controlplane.access.models import MachineCredential\n"
                    f"node, _ = Node.objects.get_or_create(name='{node_name}')\n"
                    "print('AGENT_TOKEN=' + MachineCredential.issue("
                    "'agent', 'agent-' + node.name, node=node)[1])\n"
                    f"print('ROUTER_TOKEN=' + MachineCredential.issue("
                    f"'router', '{env['ROUTER_NAME']}')[1])",
                )  # fmt: skip
                tokens = dict(
                    line.split("=", 1)
                    for line in out.splitlines()
                    if line.startswith(("AGENT_TOKEN=", "ROUTER_TOKEN="))
                )
                assert tokens["AGENT_TOKEN"].startswith("sxa_"), out
                assert tokens["ROUTER_TOKEN"].startswith("sxr_"), out
                env.update(tokens)
                write_env(env_file, env)

            api = httpx.Client(
                base_url=f"http://127.0.0.1:{web_port}/api/v1/",
                headers={"Authorization": f"Token {admin_token}"},
                timeout=30,
            )
            stack.callback(api.close)

            def node() -> dict[str, Any]:
                found = api.get("nodes/", params={"name": node_name}).json()["results"]
                return dict(found[0]) if found else {}

            with stages.stage("up router agent (healthy, node online)"):
                # --no-deps: the control plane is up; only the env file changed (the tokens).
                compose("up", "-d", "--no-deps", "router", "agent", timeout=300)
                wait_for(all_healthy(("router", "agent")), 180, "the router and the agent")
                wait_for(lambda: node().get("status") == "online", 120, "the node online")
                assert node()["address"] == "127.0.0.1", node()  # towards the gateway, here

            with stages.stage("deploy the simulated engines (running)"):
                profile = api.post(
                    "profiles/",
                    json={
                        "name": "compose-sim",
                        "model": MODEL,
                        "served_model_name": MODEL,
                        "quantization": "q4_0",
                        "engine": "simulator",
                        "pd_protocol": "vllm",
                        "sim_gpu_device": "a100-80gb",
                        "sim_cpu_device": "kunpeng-920-7280z",
                        # The project image holds `syshax sim`, the engines' default command.
                        "gpu_image": IMAGE,
                        "cpu_image": IMAGE,
                        "gpu_port": gpu_port,
                        "cpu_port": cpu_port,
                        "max_model_len": 8192,
                        "gpu_shm_size_gb": 1,
                        "health_timeout_seconds": 120,
                    },
                )
                assert profile.status_code == 201, profile.text
                created = api.post(
                    "deployments/",
                    json={
                        "name": "compose-sim",
                        "profile": profile.json()["id"],
                        "node": node()["id"],
                        "start": True,
                    },
                )
                assert created.status_code == 201, created.text
                deployment_id = created.json()["id"]

                def deployment() -> dict[str, Any]:
                    answer = api.get(f"deployments/{deployment_id}/").json()
                    if answer["state"] == "failed":
                        raise Broken(f"deployment failed: {answer['state_reason']}")
                    return dict(answer)

                running = wait_for(
                    lambda: (d := deployment())["state"] == "running" and d, 240, "running"
                )
                assert running["gpu_endpoint"] == f"http://127.0.0.1:{gpu_port}", running
                assert running["cpu_endpoint"] == f"http://127.0.0.1:{cpu_port}", running
                engines = podman.ids(f"syshax.node={node_name}")
                assert len(engines) == 2, engines

            with stages.stage("completion through the router container"):
                key = env["ROUTER_API_KEY"]
                answer = wait_for(
                    lambda: completion(router_port, "The compose stack is", key),
                    120,
                    "a completion",
                )
                # Without its API key the router refuses, in OpenAI's shape.
                refused = httpx.post(
                    f"http://127.0.0.1:{router_port}/v1/completions",
                    json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                    timeout=30,
                )
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["code"] == "invalid_api_key", refused.text
                assert answer.choices[0].text.strip(), answer
                assert answer.usage.completion_tokens > 0, answer.usage
                print(
                    f"[compose-up] completion: {answer.choices[0].text.strip()[:60]!r} "
                    f"({answer.usage.completion_tokens} tokens)",
                    flush=True,
                )

            with stages.stage("restart redis and web (healthy again)"):
                before = utc_now()
                compose("restart", "redis", "web", timeout=180)
                wait_for(all_healthy(("redis", "web"), since=before), 240, "redis and web back")
                wait_for(all_healthy(CONTROL_PLANE), 120, "the control plane healthy again")
                wait_for(all_healthy(("router", "agent")), 120, "the router and the agent")

            with stages.stage("redeploy through worker, broker and agent; completion"):
                # A restart is a Celery task that sends the agent its commands over Redis: it
                # proves worker and agent found the restarted broker again.
                generation = deployment()["generation"]
                restarted = api.post(f"deployments/{deployment_id}/restart")
                assert restarted.status_code == 202, restarted.text
                wait_for(
                    lambda: (
                        (d := deployment())["generation"] > generation and d["state"] == "running"
                    ),
                    240,
                    "the redeployed engines",
                )
                wait_for(lambda: node().get("status") == "online", 120, "the node online again")
                again = wait_for(
                    lambda: completion(router_port, "After the restart", key), 120, "a completion"
                )
                assert again.usage.completion_tokens > 0, again.usage
        except BaseException:
            diagnostics()
            raise
