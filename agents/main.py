"""The agent's life: connect, report inventory, beat, fetch commands, and survive outages.

Threads: heartbeats and command fetches each run in a daemon thread; the main thread owns the
signal handlers and waits for SIGTERM/SIGINT. Commands come only from the control plane's
``GET agent/commands`` with the agent's own token (a long poll): the agent holds no broker
credential, and a revoked token stops it at its next request. Engines never depend on the
agent: when the control plane is unreachable the engines keep running, heartbeats and fetches
back off with jitter, command results wait in an outbox on disk, and when the control plane
answers again the agent reconciles (inventory, the full container set, the outbox).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception

from agents.client import (
    ControlPlaneClient,
    ControlPlaneError,
    Unreachable,
    backoff_delay,
    jittered,
)
from agents.commands import CommandExecutor, safe_filename
from agents.discovery import (
    EngineOnCards,
    SimulatedLoadReader,
    collect_heartbeat,
    collect_inventory,
    primary_address,
)
from agents.engine_policy import EnginePolicy
from agents.runtimes import Runtime
from agents.tracing import command_tracing
from common.engine_spec import Mount
from common.files import write_json_atomic
from common.inventory import inventory_hash
from common.reports import InventoryReport

log = logging.getLogger("syshax.agent")
T = TypeVar("T")

INVENTORY_RESCAN_BEATS = 12  # re-discover hardware every N beats; resend only on change
SHUTDOWN_GRACE_SECONDS = 10.0  # a command in progress gets this long to finish on SIGTERM


@dataclass
class AgentConfig:
    control_plane: str
    token: str
    state_dir: Path
    name: str | None = None
    runtime: str = "process"
    heartbeat_interval: float | None = None
    # The engine policy (docs/agent.md): interpreters that may run engines, and the widenings.
    engine_pythons: list[str] = field(default_factory=list)  # --engine-python
    allow_images: list[str] = field(default_factory=list)  # --allow-image patterns
    allow_commands: list[str] = field(default_factory=list)  # --allow-command path patterns
    allow_env: list[str] = field(default_factory=list)  # --allow-env NAME or PREFIX*
    allow_engine_args: list[str] = field(default_factory=list)  # --allow-engine-arg FLAG
    allow_workdirs: list[str] = field(default_factory=list)  # --allow-workdir DIR
    allow_any_engine: bool = False
    pass_env: list[str] = field(default_factory=list)  # --pass-env: agent variables engines get
    simulate: list[str] = field(default_factory=list)
    docker_url: str | None = None
    address: str | None = None
    backoff_cap: float = 30.0
    mounts: list[str] = field(default_factory=list)  # SRC[:DST][:ro|rw], container runtimes
    # The kubernetes runtime (docs/kubernetes.md): the engines' namespace, the agent's own node,
    # and where the models come from.
    kubernetes_namespace: str = "syshax-engines"
    kubernetes_node: str | None = None
    kubernetes_model_claim: str | None = None
    kubernetes_model_root: str = "/models"
    kubernetes_connector_image: str | None = None
    # Where the inventory reads the host's /sys and /proc (read-only mounts in a pod).
    sys_root: str = "/sys"
    proc_root: str = "/proc"
    # Where command spans go (docs/tracing.md); None: not traced.
    otlp_traces_endpoint: str | None = None


def make_runtime(config: AgentConfig) -> Runtime:
    if config.runtime == "docker":
        # lazy: only the chosen runtime's client library loads (docker's is heavy)
        from agents.runtimes.dockerapi import DockerRuntime

        return DockerRuntime(config.docker_url, default_mounts=parse_mounts(config.mounts))
    if config.runtime == "process":
        # lazy: only the chosen runtime's client library loads
        from agents.runtimes.process import ProcessRuntime

        return ProcessRuntime(config.state_dir, pass_env=config.pass_env)
    if config.runtime == "kubernetes":
        # lazy: only the chosen runtime's client library loads (the Kubernetes client's)
        from agents.runtimes.kubernetes import KubernetesRuntime, PodOptions

        options = PodOptions(
            namespace=config.kubernetes_namespace,
            node=config.kubernetes_node,
            model_claim=config.kubernetes_model_claim,
            model_root=config.kubernetes_model_root,
            host_mounts=tuple(parse_mounts(config.mounts)),
        )
        if config.kubernetes_connector_image:
            options = replace(options, connector_image=config.kubernetes_connector_image)
        return KubernetesRuntime(options)
    raise ValueError(f"--runtime must be docker, kubernetes or process, got {config.runtime!r}")


def parse_mounts(specs: list[str]) -> list[Mount]:
    """``/models`` -> /models:/models read-only; ``/a:/b:rw`` -> writable /a at /b."""
    out = []
    for spec in specs:
        parts = spec.split(":")
        mode = parts.pop() if len(parts) > 1 and parts[-1] in ("ro", "rw") else "ro"
        if not parts[0] or len(parts) > 2:
            raise ValueError(f"--mount {spec!r}: expected SRC[:DST][:ro|rw]")
        out.append(Mount(parts[0], parts[-1], read_only=mode == "ro"))
    return out


def _worth_waiting_for(failure: BaseException) -> bool:
    """An outage, or a revoked or not-yet-issued token: the agent keeps trying rather than
    exit, so an operator can fix the token without touching the engines."""
    return isinstance(failure, Unreachable) or (
        isinstance(failure, ControlPlaneError) and failure.status in (401, 403)
    )


def _failure(state: RetryCallState) -> BaseException:
    failure = state.outcome.exception() if state.outcome is not None else None
    assert failure is not None, "tenacity waits only after a failure here"
    return failure


class _ControlPlaneWaits:
    """The waits of :meth:`Agent.retry`, as tenacity's wait, before-sleep and sleep: a
    jittered back-off that grows with each outage (a refused token does not grow it), the cap
    after each refusal, each logged; a wait the stop event ends raises the failure it followed,
    as the agent is stopping."""

    def __init__(self, what: str, cap: float, stop_event: threading.Event) -> None:
        self.what = what
        self.cap = cap
        self.stop_event = stop_event
        self.outages = itertools.count()
        self.failure: BaseException | None = None  # the one the coming wait follows

    def delay(self, state: RetryCallState) -> float:
        if isinstance(_failure(state), Unreachable):
            return backoff_delay(next(self.outages), cap=self.cap)
        return self.cap

    def announce(self, state: RetryCallState) -> None:
        self.failure = failure = _failure(state)
        if isinstance(failure, Unreachable):
            assert state.next_action is not None
            delay = state.next_action.sleep
            log.warning(
                "%s: control plane unreachable (%s); retry in %.1fs", self.what, failure, delay
            )
        else:
            log.error("%s: %s", self.what, failure)

    def sleep(self, seconds: float) -> None:
        if self.stop_event.wait(seconds):
            assert self.failure is not None
            raise self.failure


class Agent:
    def __init__(self, config: AgentConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.outbox = config.state_dir / "outbox"
        self.outbox.mkdir(exist_ok=True)
        self.client = ControlPlaneClient(config.control_plane, config.token)
        self.runtime = runtime or make_runtime(config)
        self.policy = self.spec_policy()
        for line in self.policy.widenings():
            log.warning("engine policy widened by %s", line)
        log.info("engines may run on the interpreters %s", ", ".join(self.policy.interpreters))
        self.stop_event = threading.Event()
        self.node_id = 0
        self.node_name = ""
        self.interval = config.heartbeat_interval or 5.0
        self.info: dict[str, Any] = {}
        self.inventory: Mapping[str, Any] = {}  # an InventoryReport once discovered
        self.reported_hash = ""
        self.executor: CommandExecutor | None = None
        self.command_wait = 20.0
        # This process's name at the control plane: a command is handed to a session once, so
        # a restarted agent (a new session) is handed again what it had not answered.
        self.session = uuid.uuid4().hex
        self.busy = threading.Event()  # set while a command executes
        self.online = False
        self._report_lock = threading.Lock()
        self.sim_loads = SimulatedLoadReader()
        self.tracing = command_tracing(config.otlp_traces_endpoint)

    # ------------------------------------------------------------ retries

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """Call ``fn`` until it answers: backing off with jitter while the control plane is
        unreachable, every ``backoff_cap`` while it refuses the token (401/403); any other
        failure is raised. Stopping the agent ends a wait by raising the failure before it."""
        waits = _ControlPlaneWaits(what, self.config.backoff_cap, self.stop_event)
        retrying = Retrying(
            retry=retry_if_exception(_worth_waiting_for),
            wait=waits.delay,
            before_sleep=waits.announce,
            sleep=waits.sleep,
        )
        return retrying(fn)

    # ------------------------------------------------------------ lifecycle

    def connect(self) -> None:
        self.info = self.retry(self.client.agent_self, "agent/self")
        node = self.info["node"]
        self.node_id, self.node_name = int(node["id"]), str(node["name"])
        if self.config.name and self.config.name != self.node_name:
            raise SystemExit(
                f"--name {self.config.name!r} does not match the token's node {self.node_name!r}"
            )
        self.interval = self.config.heartbeat_interval or float(
            self.info.get("heartbeat_interval_seconds", 5.0)
        )
        self.command_wait = float(self.info.get("command_wait_seconds", 20.0))
        self.executor = CommandExecutor(
            self.runtime,
            node=self.node_name,
            state_dir=self.config.state_dir,
            policy=self.policy,
        )
        self.inventory = self.discover()
        self.retry(self.sync_inventory, "inventory")
        self.retry(self.reconcile, "reconcile")
        self.online = True
        log.info("agent connected as node %s (#%d)", self.node_name, self.node_id)

    def spec_policy(self) -> EnginePolicy:
        """The engine policy of this agent's flags; a bad flag stops the agent at start."""
        config = self.config
        try:
            mounts = tuple(parse_mounts(config.mounts))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        for flag, values in (
            ("--allow-command", config.allow_commands),
            ("--allow-workdir", config.allow_workdirs),
        ):
            for value in values:
                if not os.path.isabs(value):
                    raise SystemExit(f"{flag} {value!r}: give an absolute path")
        secret = [n for n in config.pass_env if n.startswith("SYSHAX_")]
        if secret:
            raise SystemExit(f"--pass-env {secret[0]}: the agent's SYSHAX_* settings stay with it")
        own = (os.path.abspath(sys.executable),) if sys.executable else ()
        pythons = tuple(_interpreter(p) for p in config.engine_pythons)
        return EnginePolicy(
            mounts=mounts,
            interpreters=tuple(dict.fromkeys(own + pythons)),
            allow_images=tuple(config.allow_images),
            allow_commands=tuple(os.path.normpath(c) for c in config.allow_commands),
            allow_env=tuple(config.allow_env),
            allow_engine_args=tuple(config.allow_engine_args),
            workdir_roots=(os.path.abspath(config.state_dir), *config.allow_workdirs),
            allow_any_engine=config.allow_any_engine,
        )

    def discover(self) -> InventoryReport:
        return collect_inventory(
            node_name=self.node_name,
            simulated=self.config.simulate,
            address=self.config.address or _address_towards(self.config.control_plane),
            sys_root=self.config.sys_root,
            proc_root=self.config.proc_root,
        )

    def sync_inventory(self) -> None:
        answer = self.client.put_inventory(self.node_id, self.inventory)
        # Heartbeats carry the hash the control plane computed for what we sent, so the two
        # sides agree even if their hashing ever differs.
        self.reported_hash = str(answer.get("inventory_hash") or inventory_hash(self.inventory))
        log.info("inventory sent (changed=%s)", answer.get("changed"))

    def reconcile(self) -> None:
        """Tell the control plane the full engine set and deliver results it has not seen."""
        assert self.executor is not None
        self.client.put_containers(self.node_id, self.executor.all_container_states())
        self.flush_outbox()

    def engines_on_simulated_cards(self) -> list[EngineOnCards]:
        """Running GPU-role engines holding one of this node's simulated cards (by the
        ``syshax.accelerators`` label the executor stamps from the engine's spec)."""
        accelerators = self.inventory.get("accelerators", [])
        simulated = {a["uuid"] for a in accelerators if a.get("simulated")}
        if not simulated:
            return []
        labels = {"syshax.managed": "true", "syshax.node": self.node_name, "syshax.role": "gpu"}
        try:
            engines = self.runtime.list(labels)
        except Exception as exc:  # the runtime's own errors vary; the beat must still go out
            log.warning("cannot list engines for the simulated cards' load: %s", exc)
            return []
        out = []
        for engine in engines:
            cards = [c for c in engine.labels.get("syshax.accelerators", "").split(",") if c]
            if engine.status == "running" and simulated.intersection(cards):
                out.append(EngineOnCards(engine.engine_id, engine.endpoint, tuple(cards)))
        return out

    def beat(self) -> None:
        loads = self.sim_loads.read(self.engines_on_simulated_cards())
        payload = collect_heartbeat(
            self.inventory, simulated_loads=loads, inventory_hash=self.reported_hash
        )
        answer = self.client.heartbeat(self.node_id, payload)
        if answer.get("inventory_hash") != payload["inventory_hash"]:
            self.sync_inventory()
        if "heartbeat_interval_seconds" in answer and self.config.heartbeat_interval is None:
            self.interval = float(answer["heartbeat_interval_seconds"])

    def heartbeat_loop(self) -> None:
        failures = 0
        beats = 0
        while not self.stop_event.is_set():
            beats += 1
            if beats % INVENTORY_RESCAN_BEATS == 0:
                fresh = self.discover()
                if inventory_hash(fresh) != inventory_hash(self.inventory):
                    self.inventory = fresh
                    self.reported_hash = ""  # differs from the control plane's: resent next beat
            try:
                self.beat()
                if failures:
                    log.info("control plane is back after %d failed beat(s)", failures)
                    self.reconcile()
                elif any(self.outbox.glob("*.json")):
                    # A result refused earlier (a 5xx, a blip shorter than a beat): deliver it
                    # now rather than at the next command's report.
                    self.flush_outbox()
                failures = 0
                self.online = True
                delay = jittered(self.interval)
            except Unreachable as exc:
                failures += 1
                self.online = False
                delay = max(
                    0.2,
                    # At most one interval: a node silent past the grace period is marked
                    # lost, so heartbeats keep their pace (jittered) through an outage.
                    backoff_delay(
                        failures,
                        base=self.interval / 2,
                        cap=min(self.config.backoff_cap, self.interval),
                    ),
                )
                log.warning(
                    "heartbeat failed (%s); engines keep running; retry in %.1fs", exc, delay
                )
            except ControlPlaneError as exc:
                log.error("heartbeat refused: %s", exc)
                delay = jittered(self.interval)
            except Exception:
                log.exception("heartbeat crashed")
                delay = jittered(self.interval)
            self.stop_event.wait(delay)

    # ------------------------------------------------------------ commands

    def command_loop(self) -> None:
        """Fetch this node's commands and execute them one at a time, until stopped."""
        failures = 0
        while not self.stop_event.is_set():
            try:
                commands = self.client.fetch_commands(self.session, self.command_wait)
                failures = 0
            except Unreachable as exc:
                failures += 1
                delay = backoff_delay(failures, cap=self.config.backoff_cap)
                log.warning("command fetch failed (%s); retry in %.1fs", exc, delay)
                self.stop_event.wait(delay)
                continue
            except ControlPlaneError as exc:
                # 401/403: a revoked token. Nothing runs until an operator issues a new one;
                # the engines keep running.
                log.error("command fetch refused: %s", exc)
                self.stop_event.wait(self.config.backoff_cap if exc.status in (401, 403) else 5)
                continue
            for message in commands:
                if self.stop_event.is_set():
                    break  # still queued at the control plane: the next session gets it
                self.busy.set()
                try:
                    self.handle_command(**message)
                except Exception:
                    log.exception("command %s crashed", message.get("dispatch_id"))
                finally:
                    self.busy.clear()
            if not commands and self.command_wait <= 0:
                self.stop_event.wait(self.interval)

    def handle_command(self, **kwargs: Any) -> dict[str, Any]:
        assert self.executor is not None
        dispatch_id = str(kwargs["dispatch_id"])
        log.info(
            "command %s: %s deployment=%s gen=%s role=%s",
            dispatch_id,
            kwargs.get("action"),
            kwargs.get("deployment_id"),
            kwargs.get("generation"),
            kwargs.get("role"),
        )
        node = kwargs.get("node")
        if node is not None and node != self.node_name:
            # Cannot come from agent/commands, which answers for the token's node only.
            log.error(
                "command %s is for node %s, not %s: refused", dispatch_id, node, self.node_name
            )
            return {"status": "failed", "detail": f"issued to node {node}", "containers": []}
        executor = self.executor
        result, traceparent = self.tracing.handle(
            kwargs,
            lambda: executor.execute(
                dispatch_id=dispatch_id,
                action=str(kwargs["action"]),
                deployment_id=int(kwargs["deployment_id"]),
                generation=kwargs.get("generation"),
                role=kwargs.get("role"),
                spec=kwargs.get("spec"),
            ),
        )
        log.info("command %s %s: %s", dispatch_id, result["status"], result["detail"][:200])
        self.report(dispatch_id, result, traceparent)
        return result

    def _outbox_path(self, dispatch_id: str) -> Path:
        return self.outbox / (safe_filename(dispatch_id) + ".json")

    def report(self, dispatch_id: str, result: dict[str, Any], traceparent: str = "") -> None:
        # Written first, removed once delivered: a crash between the two re-sends, and the
        # control plane accepts a repeated result and ignores it. The command span's context
        # goes with it, so a result sent late still joins its trace.
        item: dict[str, Any] = {"dispatch_id": dispatch_id, "result": result}
        if traceparent:
            item["traceparent"] = traceparent
        write_json_atomic(self._outbox_path(dispatch_id), item)
        try:
            self.flush_outbox()
            assert self.executor is not None
            self.client.put_containers(self.node_id, self.executor.all_container_states())
        except (Unreachable, ControlPlaneError) as exc:
            log.warning("result of %s kept in the outbox: %s", dispatch_id, exc)

    def flush_outbox(self) -> None:
        with self._report_lock:
            for path in sorted(self.outbox.glob("*.json")):
                item = json.loads(path.read_text())
                try:
                    self.client.command_result(
                        item["dispatch_id"], item["result"], item.get("traceparent", "")
                    )
                except ControlPlaneError as exc:
                    if exc.status >= 500 or exc.status in (401, 403):
                        raise
                    # 404 etc.: the control plane no longer knows this dispatch; drop it.
                    log.warning("result of %s refused: %s", item["dispatch_id"], exc)
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------ run

    def run(self) -> int:
        self.connect()
        threads = [
            threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self.command_loop, name="commands", daemon=True),
        ]
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: self.stop_event.set())
        for thread in threads:
            thread.start()
        try:
            self.stop_event.wait()
        finally:
            self.stop_event.set()
            if self.busy.is_set():
                log.info("waiting up to %.0fs for the command in progress", SHUTDOWN_GRACE_SECONDS)
            threads[1].join(timeout=SHUTDOWN_GRACE_SECONDS if self.busy.is_set() else 0.1)
            threads[0].join(timeout=5)
            self.client.close()
            self.sim_loads.close()
            self.tracing.shutdown()
        return 0

    def stop(self) -> None:
        self.stop_event.set()


def _interpreter(name: str) -> str:
    """An ``--engine-python`` as the absolute path a spec's program is compared with."""
    if "/" not in name:
        found = shutil.which(name)
        if found is None:
            raise SystemExit(f"--engine-python {name!r} is not on PATH")
        name = found
    return os.path.abspath(name)


def _address_towards(url: str) -> str | None:
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname
    if not host:
        return None
    try:
        return primary_address(socket.gethostbyname(host))
    except OSError:
        return None
