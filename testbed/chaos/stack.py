"""The chaos suite's own system: a throwaway Redis and PostgreSQL, the control plane (web,
worker, beat), one node agent with the process runtime and a simulated A100, simulated engines
started by that agent, and one managed router, as ``syshax up`` wires them.

Everything is measured from outside the processes, so the suite does not depend on how a
command reaches the agent:

* the deployment and its agent commands through the REST API (a person's token);
* every engine process start from a ledger: the profile's engine command is a small shim that
  appends one line (its PID, its launcher's PID, its engine name) and then execs
  ``syshax sim``. One runtime start is one launcher; a launcher that restarts a dead engine
  keeps its PID, so a restart is not counted as a second start;
* the engines running now from ``/proc`` (the engine name is the log file on its stdout).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from common.supervisor import free_port, python_argv, wait_until
from testbed.chaos.procs import Proc, ProcessExit, Supervisor
from testbed.services import PostgresServer, RedisServer, throwaway_postgres, throwaway_redis

ROOT = Path(__file__).resolve().parents[2]
# What the stack's processes run: copied at start-up, so a process restarted mid-run runs the
# code the run began with even while the working tree changes under it.
SNAPSHOT = (
    "agents",
    "common",
    "controlplane",
    "hetero",
    "kvbench",
    "kvconnector",
    "loadgen",
    "router",
    "sim",
    "syshax",
    "testbed",
    "templates",
    "manage.py",
    "pyproject.toml",
)
MODEL = "qwen2.5-7b-instruct"
NODE = "chaos-node"
DEPLOYMENT = "chaos-hetero"
# The control plane's defaults, pinned: the reaper marks a node offline after
# HEARTBEAT_INTERVAL_S x HEARTBEAT_TOLERANCE without a heartbeat.
HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_TOLERANCE = 3.0
ENGINE_NAME = re.compile(r"syshax-(\d+)-g(\d+)-(gpu|cpu)")

# Appends one JSON line per engine process start, waits the simulated load time, then execs
# the simulator with the engine's own arguments.
ENGINE_SHIM = """\
import json, os, sys, time
ledger, delay, args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
try:
    log = os.readlink("/proc/self/fd/1")
except OSError:
    log = ""
line = {"t": time.time(), "pid": os.getpid(), "launcher": os.getppid(), "log": log}
with open(ledger, "a") as f:
    f.write(json.dumps(line) + "\\n")
time.sleep(delay)
os.execv(sys.executable, [sys.executable, "-m", "syshax.cli", "sim", *args])
"""


@dataclass(frozen=True)
class StackConfig:
    sim_speed: float = 1.0
    engine_start_delay_s: float = 1.0  # model load time added to every engine start
    health_timeout_s: float = 20.0  # the profile's: how long a start may wait for /health
    startup_timeout_s: float = 180.0


class Api:
    """The REST API as a person's automation uses it. Calls made while the control plane is
    down answer None instead of raising."""

    def __init__(self, base: str, token: str) -> None:
        self.base = base
        self.client = httpx.Client(
            base_url=f"{base}/api/v1/", headers={"Authorization": f"Token {token}"}, timeout=10
        )

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None

    def maybe(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return self.call(method, path, **kwargs)
        except (httpx.HTTPError, RuntimeError, ValueError):
            return None

    def healthy(self) -> bool:
        try:
            return self.client.get("health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self.client.close()


@dataclass
class EngineStart:
    t: float
    pid: int
    launcher: int
    deployment: int
    generation: int
    role: str


@dataclass
class ChaosStack:
    workdir: Path
    redis: RedisServer
    postgres: PostgresServer
    config: StackConfig = field(default_factory=StackConfig)
    procs: dict[str, Proc] = field(default_factory=dict)
    api: Api | None = None
    deployment_id: int = 0
    node_id: int = 0
    gpu_port: int = 0
    cpu_port: int = 0
    router_url: str = ""
    supervisor: Supervisor | None = None

    # ------------------------------------------------------------ processes

    def env(self) -> dict[str, str]:
        bin_dir = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "SYSHAX_"))}
        env.update(
            PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            PYTHONPATH=str(self.src),
            PYTHONUNBUFFERED="1",
            DJANGO_SETTINGS_MODULE="controlplane.settings.local",
            DATABASE_URL=self.postgres.url("syshax"),
            REDIS_URL=self.redis.url,
            SYSHAX_VAR_DIR=str(self.workdir / "var"),
            SYSHAX_ENV_FILE=str(self.workdir / "none.env"),
            HEARTBEAT_INTERVAL_SECONDS=str(HEARTBEAT_INTERVAL_S),
            HEARTBEAT_TOLERANCE=str(HEARTBEAT_TOLERANCE),
        )
        return env

    def add(self, name: str, argv: list[str], **extra_env: str) -> Proc:
        (self.workdir / "logs").mkdir(exist_ok=True)
        proc = Proc(name, argv, {**self.env(), **extra_env}, self.workdir / "logs", self.src)
        self.procs[name] = proc
        return proc

    def alive(self) -> None:
        for proc in self.procs.values():
            if proc.popen is not None and not proc.alive and proc.popen.returncode != -9:
                raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")

    def start_control_plane(self) -> None:
        for name in ("web", "worker", "beat"):
            self.procs[name].start()
        wait_until(self.api_healthy, self.config.startup_timeout_s, "the web app", interval=0.2)

    def kill_control_plane(self) -> None:
        for name in ("web", "worker", "beat"):
            self.procs[name].kill()

    def api_healthy(self) -> bool:
        assert self.api is not None
        return self.api.healthy()

    # ------------------------------------------------------------ bring-up

    @property
    def src(self) -> Path:
        return self.workdir / "src"

    def snapshot(self) -> None:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for name in SNAPSHOT:
            source, target = ROOT / name, self.src / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, ignore=ignore, dirs_exist_ok=True)
            else:
                shutil.copy2(source, target)

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.snapshot()
        self.postgres.create_database("syshax")
        boot = subprocess.run(
            [sys.executable, "-m", "testbed.chaos.bootstrap"],
            env=self.env(),
            cwd=self.src,
            capture_output=True,
            text=True,
            timeout=self.config.startup_timeout_s,
        )
        if boot.returncode != 0:
            raise RuntimeError(f"bootstrap failed:\n{boot.stdout}\n{boot.stderr[-4000:]}")
        token = json.loads(boot.stdout.strip().splitlines()[-1])["token"]
        web_port = free_port()
        base = f"http://127.0.0.1:{web_port}"
        self.api = Api(base, token)
        web = ["web", "--bind", f"127.0.0.1:{web_port}", "--workers", "2", "--threads", "8"]
        self.add("web", python_argv(*web, "--no-migrate"))
        self.add("worker", python_argv("worker", "--concurrency", "2"))
        self.add("beat", python_argv("beat"))
        self.start_control_plane()
        self.create_fleet(base)
        self.procs["agent"].start()
        wait_until(self.node_online, self.config.startup_timeout_s, "the node", interval=0.3)
        self.create_deployment()
        self.deploy()
        wait_until(
            lambda: self.deployment_at("running", 1),
            self.config.startup_timeout_s,
            "the first deploy",
            interval=0.3,
            alive=self.alive,
        )
        self.procs["router"].start()
        wait_until(
            lambda: self.router_serves(), self.config.startup_timeout_s, "the router", interval=0.3
        )
        self.supervisor = Supervisor(self.procs)
        self.supervisor.start()

    def exits_since(self, since: float) -> list[ProcessExit]:
        """Processes that exited on their own (and were restarted) since ``since``."""
        exits = self.supervisor.exits if self.supervisor is not None else []
        return [e for e in exits if e.t >= since]

    def create_fleet(self, base: str) -> None:
        assert self.api is not None
        api = self.api
        node = api.call("POST", "nodes/", json={"name": NODE, "address": "127.0.0.1"})
        self.node_id = int(node["id"])
        agent_token = api.call("POST", f"nodes/{self.node_id}/agent-token")["token"]
        router_token = api.call(
            "POST", "credentials/", json={"kind": "router", "name": "chaos-router"}
        )["token"]
        self.add(
            "agent",
            python_argv(
                "agent",
                "--control-plane",
                base,
                "--runtime",
                "process",
                "--simulate-accelerator",
                "a100-80gb",
                "--state-dir",
                str(self.workdir / "agent"),
                "--address",
                "127.0.0.1",
                # The engines start through ENGINE_SHIM, a script the default policy refuses.
                "--allow-any-engine",
            ),
            SYSHAX_AGENT_TOKEN=agent_token,
        )
        router_port = free_port()
        self.router_url = f"http://127.0.0.1:{router_port}"
        self.add(
            "router",
            python_argv(
                "router",
                "--control-plane",
                base,
                "--name",
                "chaos-router",
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--state-dir",
                str(self.workdir / "router"),
                # The probes and the load force modes; this stack has no client keys.
                "--mode-header",
                "all",
            ),
            SYSHAX_ROUTER_TOKEN=router_token,
        )

    def create_deployment(self) -> None:
        """The hetero profile on the shim, placed on the node (it must have reported its
        card first)."""
        assert self.api is not None
        api = self.api
        self.gpu_port, self.cpu_port = free_port(), free_port()
        shim = self.workdir / "engine_shim.py"
        shim.write_text(ENGINE_SHIM)
        command = [
            sys.executable,
            str(shim),
            str(self.ledger_path),
            str(self.config.engine_start_delay_s),
        ]
        speed = ["--speed", str(self.config.sim_speed)]
        profile = api.call(
            "POST",
            "profiles/",
            json={
                "name": "chaos-sim",
                "model": MODEL,
                "served_model_name": MODEL,
                "engine": "simulator",
                "pd_protocol": "vllm",
                "quantization": "none",
                "sim_gpu_device": "a100-80gb",
                "sim_cpu_device": "kunpeng-920-7280z",
                "gpu_command": command,
                "cpu_command": command,
                "gpu_extra_args": speed,
                "cpu_extra_args": speed,
                "gpu_port": self.gpu_port,
                "cpu_port": self.cpu_port,
                "max_model_len": 4096,
                "health_timeout_seconds": self.config.health_timeout_s,
            },
        )
        deployment = api.call(
            "POST",
            "deployments/",
            json={"name": DEPLOYMENT, "profile": profile["id"], "node": self.node_id},
        )
        self.deployment_id = int(deployment["id"])

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.halt.set()
        # All at once, then a shared grace period: stopping them one by one takes long.
        procs = [p for p in self.procs.values() if p.alive]
        for proc in procs:
            proc.held = True
            proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + 8
        for proc in procs:
            assert proc.popen is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            proc.kill()
        for pid in self.engine_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        if self.api is not None:
            self.api.close()

    # ------------------------------------------------------------ the control plane's view

    def deployment(self) -> dict[str, Any] | None:
        assert self.api is not None
        found: dict[str, Any] | None = self.api.maybe("GET", f"deployments/{self.deployment_id}/")
        return found

    def deployment_at(self, state: str, generation: int) -> bool:
        found = self.deployment()
        return bool(found and found["state"] == state and found["generation"] == generation)

    def node_online(self) -> bool:
        assert self.api is not None
        node = self.api.maybe("GET", f"nodes/{self.node_id}/")
        return bool(node and node.get("status") == "online")

    def node_fresh(self) -> bool:
        """Online, with a heartbeat within the last 1.5 periods: the agent is beating again,
        not merely not yet reaped after an outage of the control plane."""
        assert self.api is not None
        node = self.api.maybe("GET", f"nodes/{self.node_id}/")
        if not node or node.get("status") != "online" or not node.get("last_heartbeat_at"):
            return False
        beat = datetime.fromisoformat(str(node["last_heartbeat_at"]).replace("Z", "+00:00"))
        return time.time() - beat.timestamp() <= 1.5 * HEARTBEAT_INTERVAL_S + 1.0

    def healthy_at(self, generation: int) -> bool:
        """The whole system back: the node beating, the deployment running at
        ``generation`` and the router serving both routes."""
        return (
            self.deployment_at("running", generation) and self.node_fresh() and self.router_serves()
        )

    def deploy(self) -> int:
        """Ask for a (re)deploy; the new generation."""
        assert self.api is not None
        self.api.call("POST", f"deployments/{self.deployment_id}/deploy")
        found = self.deployment()
        assert found is not None
        return int(found["generation"])

    def commands(self, generation: int | None = None) -> list[dict[str, Any]] | None:
        assert self.api is not None
        page = self.api.maybe(
            "GET", "commands/", params={"deployment": self.deployment_id, "limit": 1000}
        )
        if page is None:
            return None
        rows: list[dict[str, Any]] = page["results"] if isinstance(page, dict) else page
        return [r for r in rows if generation is None or r["generation"] == generation]

    # ------------------------------------------------------------ engines from outside

    @property
    def ledger_path(self) -> Path:
        return self.workdir / "engine-starts.jsonl"

    def engine_starts(self) -> list[EngineStart]:
        out = []
        try:
            lines = self.ledger_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        for line in lines:
            row = json.loads(line)
            match = ENGINE_NAME.search(Path(row["log"]).name)
            if match:
                dep, gen, role = match.groups()
                out.append(
                    EngineStart(row["t"], row["pid"], row["launcher"], int(dep), int(gen), role)
                )
        return out

    def engine_pids(self, role: str | None = None) -> list[int]:
        """Simulator processes running now for this deployment (optionally of one role)."""
        return [pid for pid, (_, r) in self.running_engines().items() if role in (None, r)]

    def running_engines(self) -> dict[int, tuple[int, str]]:
        """PID -> (generation, role) of every engine of this deployment alive now."""
        out = {}
        for process in psutil.process_iter(["pid", "cmdline", "status"]):
            cmdline = process.info["cmdline"] or []
            if "syshax.cli" not in cmdline or "sim" not in cmdline:
                continue
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                log = os.readlink(f"/proc/{process.pid}/fd/1")
            except OSError:
                continue
            match = ENGINE_NAME.search(Path(log).name)
            if match and int(match.group(1)) == self.deployment_id:
                out[process.pid] = (int(match.group(2)), match.group(3))
        return out

    # ------------------------------------------------------------ the router

    def router_health(self) -> dict[str, Any] | None:
        try:
            response = httpx.get(f"{self.router_url}/health", timeout=2)
            body: dict[str, Any] = response.json()
            return body
        except (httpx.HTTPError, ValueError):
            return None

    def router_counters(self, metric: str) -> dict[str, float]:
        """``metric``'s samples from the router's /metrics, by their ``kind`` label."""
        try:
            text = httpx.get(f"{self.router_url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith(metric + "{"):
                labels, _, value = line.rpartition(" ")
                kind = re.search(r'kind="([^"]*)"', labels)
                out[kind.group(1) if kind else labels] = float(value)
        return out

    def router_backends_up(self) -> bool:
        health = self.router_health()
        if not health or health.get("status") != "ok":
            return False
        backends = health.get("backends") or []
        roles = {b["role"] for b in backends if b["up"] and not b["ejected"]}
        return {"gpu", "cpu"} <= roles

    def probe(self, mode: str, want_route: str | None = None) -> bool:
        """One short streamed completion through the router in ``mode``, whole and on
        ``want_route`` (the X-Syshax-Route it reports)."""
        body = {"model": MODEL, "prompt": "probe", "max_tokens": 4, "stream": True}
        try:
            with httpx.stream(
                "POST",
                f"{self.router_url}/v1/completions",
                json=body,
                headers={"X-Syshax-Mode": mode},
                timeout=30,
            ) as response:
                if response.status_code != 200:
                    return False
                route = response.headers.get("X-Syshax-Route")
                text = "".join(response.iter_text())
        except httpx.HTTPError:
            return False
        whole = "data: [DONE]" in text and '"error"' not in text
        return whole and (want_route is None or route == want_route)

    def router_serves(self) -> bool:
        return self.router_backends_up() and self.probe("gpu-only") and self.probe("forced-pd")


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2
) -> float | None:
    """Poll ``predicate``; the monotonic time it first held, or None if it never did."""
    with contextlib.suppress(AssertionError):
        wait_until(predicate, timeout, what, interval=interval)
        return time.monotonic()
    return None


@contextlib.contextmanager
def chaos_stack(workdir: Path, config: StackConfig | None = None) -> Iterator[ChaosStack]:
    """Throwaway Redis and PostgreSQL plus the whole stack on them, torn down afterwards."""
    with throwaway_redis() as redis, throwaway_postgres() as postgres:
        stack = ChaosStack(workdir, redis, postgres, config or StackConfig())
        try:
            stack.start()
            yield stack
        finally:
            stack.close()
