"""A fleet of separate hosts for a test: the control plane, node agents and routers, each on
a machine of its own (tests/support/netns.py), talking only over the private network.

    fleet.start_control_plane()              # web, gateway, worker on the host's side
    n1 = fleet.add_node("n1")                # a Node row, its token, its namespace, its agent
    router = fleet.router()                  # a managed router in a namespace of its own
    fleet.kill_node("n1")                    # the machine is lost, engines and all
    fleet.restore_node("n1")                 # back: new namespace, same address, agent again

The control plane runs in the host's namespace because it must reach PostgreSQL and Redis on
the host's 127.0.0.1, which no namespace can; it binds only the bridge address, so to every
other machine it is simply ``http://<that address>:<port>``: web for people, the machine
gateway in front of it for agents and routers, as a deployment runs them. Those get a bare
environment (no database or broker URL), as a real remote machine would. Rows are written
with the ORM in the test's own process, on the suite's test database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from django.contrib.auth.models import User
from django.db import connections

from agents.runtimes import EngineState
from agents.runtimes.process import ProcessRuntime
from controlplane.access.models import MachineCredential
from controlplane.inventory.models import Node
from controlplane.inventory.services import mark_lost_nodes
from tests.support.controlplane import child_env, wait_until
from tests.support.netns import Host, Network

SYSHAX = (sys.executable, "-m", "syshax.cli")
ROUTER_PORT = 7010  # every router has a machine to itself, so the default port is free
# Variables a remote machine would have anyway; nothing that names the control plane's
# database, broker or secrets.
MACHINE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSHAX_ENV_FILE")


class Proc:
    """One process of the fleet, in its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def alive(self) -> None:
        """Raise (for ``wait_until(alive=...)``) when the process has exited."""
        code = self.popen.poll()
        if code is not None:
            raise AssertionError(f"{self.name} exited with {code}:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def send(self, sig: int) -> None:
        if self.popen.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Signal the group, wait up to ``timeout``, then SIGKILL whatever is left of it."""
        self.send(sig)
        with suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(5)


@dataclass
class ClusterNode:
    """A node's row, credential and machine. ``report_address`` False leaves ``--address``
    off, so the agent reports the source address of its route to the control plane."""

    name: str
    pk: int
    token: str
    host: Host
    state_dir: Path
    accelerators: tuple[str, ...]
    report_address: bool
    agent: Proc | None = None
    starts: int = 0

    @property
    def runtime(self) -> ProcessRuntime:
        """The process runtime's view of this node's engines (PIDs are global, so the test
        process can read the records the agent keeps in its state dir)."""
        return ProcessRuntime(self.state_dir)

    def running_engines(self) -> list[EngineState]:
        return [e for e in self.runtime.list({}) if e.status == "running"]


@dataclass
class ClusterRouter:
    name: str
    host: Host
    proc: Proc
    url: str

    def health(self) -> dict[str, object]:
        data: dict[str, object] = httpx.get(self.url + "/health", timeout=5).json()
        return data

    def backends(self) -> set[str]:
        """The engine URLs the router routes to now."""
        backends = self.health().get("backends") or []
        assert isinstance(backends, list)
        return {str(b["url"]) for b in backends}


@dataclass
class Fleet:
    network: Network
    tmp: Path
    interval: float = 0.5
    tolerance: float = 3.0
    port: int = 8000  # the bridge address is ours alone, so the usual port is free on it
    gateway_port: int = 8010  # the machine gateway, in front of web: what machines talk to
    nodes: dict[str, ClusterNode] = field(default_factory=dict)
    routers: dict[str, ClusterRouter] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    admin: User | None = None

    @property
    def url(self) -> str:
        """Web: what people (and these tests) use."""
        return f"http://{self.network.host.address}:{self.port}"

    @property
    def machines_url(self) -> str:
        """The machine gateway: what agents and routers use, as deployments run them."""
        return f"http://{self.network.host.address}:{self.gateway_port}"

    # ---------------------------------------------------------------- processes

    def _start(self, name: str, host: Host, argv: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(name, host.argv(argv), env, self.tmp / f"{name}.log")
        self.procs.append(proc)
        if host.netns is None:  # a namespace's processes die with it; these would not
            self.network.track(proc.popen.pid)
        return proc

    def control_plane_env(self) -> dict[str, str]:
        return child_env(
            HEARTBEAT_INTERVAL_SECONDS=str(self.interval),
            HEARTBEAT_TOLERANCE=str(self.tolerance),
            # Requests arrive with Host: <bridge address>; Django refuses unlisted hosts.
            ALLOWED_HOSTS=f"127.0.0.1,localhost,{self.network.host.address}",
        )

    def machine_env(self, **extra: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in MACHINE_ENV if k in os.environ}
        return {**env, "PYTHONUNBUFFERED": "1", **extra}

    def start_control_plane(self) -> None:
        """Web (gunicorn, bound to the bridge address only), the machine gateway in front of
        it, and one Celery worker."""
        env = self.control_plane_env()
        bind = f"{self.network.host.address}:{self.port}"
        # The gateway holds the agents' long polls; a fetch with a command goes on to a thread.
        web = [*SYSHAX, "web", "--bind", bind, "--no-migrate", "--workers", "1", "--threads", "12"]
        web_proc = self._start("web", self.network.host, web, env)
        gateway = [*SYSHAX, "gateway", "--bind", f"{self.network.host.address}:{self.gateway_port}"]
        gateway_proc = self._start(
            "gateway", self.network.host, [*gateway, "--upstream", self.url], env
        )
        self._start("worker", self.network.host, [*SYSHAX, "worker", "--concurrency", "1"], env)
        wait_until(
            lambda: _answers(self.url + "/api/v1/health"), 60, "the web app", alive=web_proc.alive
        )
        wait_until(
            lambda: _answers(self.machines_url + "/api/v1/health"),
            60,
            "the machine gateway",
            alive=gateway_proc.alive,
        )
        self.admin = User.objects.create_superuser("cluster-admin", "admin@example.com", "x")

    # -------------------------------------------------------------------- nodes

    def add_node(
        self,
        name: str,
        *,
        accelerators: tuple[str, ...] = ("a100-80gb",),
        report_address: bool = True,
        labels: dict[str, str] | None = None,
    ) -> ClusterNode:
        """Register node ``name`` (no address: its agent reports one), give it a machine and
        start its agent there, with one simulated card per preset in ``accelerators``."""
        host = self.network.add(name)
        row = Node.objects.create(name=name, labels=labels or {})
        token = MachineCredential.issue("agent", f"agent-{name}", node=row)[1]
        connections.close_all()
        node = ClusterNode(
            name, row.pk, token, host, self.tmp / f"state-{name}", accelerators, report_address
        )
        self.nodes[name] = node
        self._start_agent(node)
        return node

    def _start_agent(self, node: ClusterNode) -> None:
        node.starts += 1
        argv = [*SYSHAX, "agent", "--control-plane", self.machines_url]
        argv += ["--name", node.name, "--runtime", "process", "--state-dir", str(node.state_dir)]
        for preset in node.accelerators:
            argv += ["--simulate-accelerator", preset]
        if node.report_address:
            argv += ["--address", node.host.address]
        env = self.machine_env(SYSHAX_AGENT_TOKEN=node.token)
        node.agent = self._start(f"agent-{node.name}-{node.starts}", node.host, argv, env)

    def kill_node(self, name: str, *, silent: bool = False) -> None:
        """The machine is lost: everything on it is SIGKILLed and its namespace deleted.

        ``silent`` pulls its cable first, so no peer learns of it from a reset connection
        (a power cut); otherwise the dying processes' sockets reset their peers (a crash)."""
        node = self.nodes[name]
        if silent:
            self.network.cut(name)
        self.network.remove(name)  # SIGKILLs the agent, the launchers and the engines
        if node.agent is not None:
            node.agent.stop(signal.SIGKILL)
            node.agent = None

    def restore_node(self, name: str) -> ClusterNode:
        """The machine comes back with the same address and disk (state dir); the agent is
        started again with the same token. Its engines died with it."""
        node = self.nodes[name]
        node.host = self.network.restore(name)
        self._start_agent(node)
        return node

    def node_row(self, name: str) -> Node:
        return Node.objects.get(pk=self.nodes[name].pk)

    def wait_online(self, *names: str, timeout: float = 60) -> None:
        def online() -> bool:
            for name in names:
                agent = self.nodes[name].agent
                if agent is not None:
                    agent.alive()
            return all(self.node_row(n).status == "online" for n in names)

        wait_until(online, timeout, f"nodes {', '.join(names)} online", interval=0.2)

    def reap(self) -> list[str]:
        """What beat's ``inventory.reap_lost_nodes`` does, now (names of nodes marked lost)."""
        lost = set(mark_lost_nodes())
        return [n.name for n in self.nodes.values() if n.pk in lost]

    # ------------------------------------------------------------------ routers

    def router(self, name: str = "router-a", **flags: str) -> ClusterRouter:
        """A managed router on a machine of its own, polling the control plane."""
        host = self.network.add(name)
        token = MachineCredential.issue("router", name)[1]
        connections.close_all()
        argv = [*SYSHAX, "router", "--control-plane", self.machines_url]
        argv += ["--name", name, "--host", host.address, "--port", str(ROUTER_PORT)]
        argv += ["--state-dir", str(self.tmp / f"state-{name}"), "--poll-interval", "0.25"]
        argv += ["--stats-interval", "1"]
        for flag, value in flags.items():
            argv += [f"--{flag.replace('_', '-')}", value]
        proc = self._start(name, host, argv, self.machine_env(SYSHAX_ROUTER_TOKEN=token))
        router = ClusterRouter(name, host, proc, f"http://{host.address}:{ROUTER_PORT}")
        wait_until(lambda: _answers(router.url + "/health"), 30, name, alive=proc.alive)
        self.routers[name] = router
        return router

    # ---------------------------------------------------------------- tear-down

    def close(self) -> None:
        """Stop every process; the network's own teardown then SIGKILLs what is left in each
        namespace (the engines) and deletes the namespaces. Whatever has not exited 2 s after
        SIGTERM is killed: the web's threads sit in agents' long polls, which gunicorn's
        graceful shutdown would wait out."""
        for proc in self.procs:
            proc.send(signal.SIGTERM)
        deadline = time.monotonic() + 2
        for proc in self.procs:
            proc.stop(timeout=max(0.0, deadline - time.monotonic()))
        self.procs.clear()


def _answers(url: str) -> bool:
    """Whether anything answers HTTP at ``url`` (a router with no engine yet answers 503)."""
    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True
