"""Execute one control-plane command against a runtime, idempotently (docs/agent.md).

Idempotency has two layers. A ``dispatch_id`` already executed returns its stored result (kept
in ``<state-dir>/dispatches``, so it survives an agent restart). And every action first looks at
what already runs, by labels, so a command redelivered after a crash half-way through adopts the
engine it had started instead of starting a second one.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agents.engine_policy import EnginePolicy
from agents.runtimes import EngineRuntimeError, EngineState, Runtime
from common.engine_spec import (
    ROLES,
    EngineSpec,
    SpecError,
    engine_labels,
    engine_name,
    flag_value,
)
from common.files import write_json_atomic
from common.model_card import ModelCardError, read_model_card

ACTIONS = ("start", "stop", "restart", "inspect", "logs")
LOG_TAIL_LINES = 20
# How much of a failed engine's log the agent searches for the cause and keeps on disk.
LOG_KEEP_LINES = 5000
# Failed engines' logs kept in <state-dir>/engine-logs; the oldest go first.
LOGS_KEPT = 50
# A cause is one line of at most this many characters (vLLM's unsupported-architecture error
# lists every architecture it has).
CAUSE_CHARS = 400
# A line of an engine's log that states why it stopped (argparse, a Python exception).
CAUSE_LINE = re.compile(r"(?:^|[\s:.])(?:\w*Error|error|Exception):\s")
# pydantic's summary line; the cause is the message on the lines under it.
VALIDATION_SUMMARY = re.compile(r"ValidationError: \d+ validation errors? for \w+")
VALIDATION_DETAIL = re.compile(
    r"^\s+(?:Value error, |Assertion failed, )?(?P<msg>.*?)(?: \[type=.*)?$"
)
# Lines that say only that something failed earlier: the cause is above them.
GENERIC_CAUSES = (
    "Engine core initialization failed",
    "See root cause above",
    "EngineDeadError",
    "Engine process failed to start",
)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 1] + "…"


def engine_cause(log: str) -> str | None:
    """The line of an engine's log that says why it stopped, or None.

    The last error line that is not a generic "failed, see above"; for a pydantic validation
    error (how vLLM 0.32 refuses a configuration: a max_model_len over the model's, an
    unsupported architecture, a directory without config.json) the message under its summary
    line, which is what a person needs, rather than the summary itself."""
    lines = log.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index]
        if VALIDATION_SUMMARY.search(line):
            for detail in lines[index + 1 : index + 4]:
                found = VALIDATION_DETAIL.match(detail)
                if found and found["msg"].strip() and not detail.lstrip().startswith("For further"):
                    return _one_line(found["msg"])
            return _one_line(line)
        if CAUSE_LINE.search(line) and not any(g in line for g in GENERIC_CAUSES):
            return _one_line(line)
    return None


def check_model(spec: EngineSpec, *, local: bool) -> None:
    """The model directory an engine is to load, checked before it starts: one line naming the
    cause (no such directory, no config.json, no architectures, a ``--max-model-len`` over the
    model's own) instead of an engine that dies with a traceback two minutes later.

    A hub id is left to the engine, as is a path this agent cannot see: a container's own
    (``local`` False) that is not also on the host."""
    model = flag_value(spec.args, "--model")
    if model is None or not model.startswith("/"):
        return
    if not local and not Path(model).exists():
        return
    try:
        card = read_model_card(model, field="--model")
        length = flag_value(spec.args, "--max-model-len")
        card.check_max_model_len(
            int(length) if length and length.isdigit() else None, field="--max-model-len"
        )
    except ModelCardError as exc:
        raise CommandFailed(f"spec.args {exc}") from None


def failure_story(log: str, tail: str, node: str, kept: Path | None) -> str:
    """Why an engine stopped, for a deployment event: the cause in one line first (vLLM's own
    refusal, ``unrecognized arguments: …``, ``No module named …``), then where its whole log is
    kept on the node, then its last lines."""
    # Without an error line, the last thing the engine said.
    cause = engine_cause(log) or next(
        (_one_line(line) for line in reversed(tail.splitlines()) if line.strip()), None
    )
    parts = [
        cause,
        f"full log: {node}:{kept}" if kept else None,
        None if cause is not None and tail.strip() == cause else tail,
    ]
    return " | ".join(part for part in parts if part)


@dataclass
class CommandResult:
    status: str  # succeeded | failed
    detail: str = ""
    containers: list[dict[str, Any]] = field(default_factory=list)
    output: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "detail": self.detail,
            "containers": self.containers,
            "output": self.output,
        }


class CommandFailed(Exception):
    def __init__(self, detail: str, containers: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.containers = containers or []


def safe_filename(dispatch_id: str) -> str:
    """A dispatch id as a file name: anything but ``[A-Za-z0-9_.-]`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", dispatch_id)


def probe(endpoint: str | None, path: str, timeout: float = 1.0) -> tuple[bool, str]:
    if not endpoint:
        return False, "engine has no port"
    try:
        r = httpx.get(endpoint + path, timeout=timeout)
    except httpx.HTTPError as exc:
        return False, f"{path}: {type(exc).__name__}"
    return r.status_code == 200, f"{path}: HTTP {r.status_code}"


class CommandExecutor:
    def __init__(
        self,
        runtime: Runtime,
        *,
        node: str,
        state_dir: str | Path,
        poll_interval: float = 0.1,
        policy: EnginePolicy | None = None,
    ) -> None:
        self.runtime = runtime
        self.node = node
        # The default is the agent's default policy: the engine kinds the project issues.
        self.policy = policy or EnginePolicy()
        self.dispatch_dir = Path(state_dir) / "dispatches"
        self.dispatch_dir.mkdir(parents=True, exist_ok=True)
        self.engine_logs_dir = Path(state_dir) / "engine-logs"
        self.poll_interval = poll_interval
        # One command at a time: two starts racing on one deployment would both see "absent".
        self._lock = threading.Lock()

    # ------------------------------------------------------------ ledger

    def _ledger_path(self, dispatch_id: str) -> Path:
        return self.dispatch_dir / f"{safe_filename(dispatch_id)}.json"

    def stored_result(self, dispatch_id: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._ledger_path(dispatch_id).read_text())
        except (OSError, ValueError):
            return None
        return data

    def _store(self, dispatch_id: str, result: dict[str, Any]) -> None:
        write_json_atomic(self._ledger_path(dispatch_id), result)

    # ------------------------------------------------------------ entry point

    def execute(
        self,
        *,
        dispatch_id: str,
        action: str,
        deployment_id: int,
        generation: int | None = None,
        role: str | None = None,
        spec: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        with self._lock:
            stored = self.stored_result(dispatch_id)
            if stored is not None:
                return stored
            try:
                result = self._dispatch(
                    action, dispatch_id, int(deployment_id), generation, role, spec or {}
                )
            except CommandFailed as exc:
                result = CommandResult("failed", exc.detail, exc.containers)
            except (SpecError, EngineRuntimeError) as exc:
                result = CommandResult("failed", str(exc))
            data = result.to_dict()
            self._store(dispatch_id, data)
            return data

    def _dispatch(
        self,
        action: str,
        dispatch_id: str,
        deployment_id: int,
        generation: int | None,
        role: str | None,
        spec: Mapping[str, Any],
    ) -> CommandResult:
        if action not in ACTIONS:
            raise CommandFailed(f"unknown action {action!r} (known: {', '.join(ACTIONS)})")
        if role is not None and role not in ROLES:
            raise CommandFailed(f"unknown role {role!r} (known: gpu, cpu)")
        if action in ("start", "restart"):
            if generation is None or role is None:
                raise CommandFailed(f"{action} needs a generation and a role")
            engine_spec = self.policy.check(EngineSpec.from_dict(spec), self.runtime.name)
            check_model(engine_spec, local=self.runtime.name == "process")
            if action == "restart":
                self._stop(deployment_id, generation, role)
            result = self._start(dispatch_id, deployment_id, generation, role, engine_spec)
            if engine_spec.ignored_keys:
                result.output["ignored_spec_keys"] = list(engine_spec.ignored_keys)
            return result
        if action == "stop":
            keep = spec.get("keep_generation")
            return self._stop(deployment_id, None, role, keep=None if keep is None else int(keep))
        engines = self._engines(deployment_id, generation, role)
        if action == "inspect":
            return CommandResult("succeeded", containers=[self.container_state(e) for e in engines])
        tail = int(spec.get("tail", 200))
        return CommandResult(
            "succeeded",
            containers=[self.container_state(e) for e in engines],
            output={"logs": {e.name: self.runtime.logs(e.engine_id, tail) for e in engines}},
        )

    # ------------------------------------------------------------ actions

    def _engines(
        self, deployment_id: int, generation: int | None, role: str | None
    ) -> list[EngineState]:
        labels = {
            "syshax.managed": "true",
            "syshax.node": self.node,
            "syshax.deployment": str(deployment_id),
        }
        if generation is not None:
            labels["syshax.generation"] = str(generation)
        if role is not None:
            labels["syshax.role"] = role
        return self.runtime.list(labels)

    def container_state(self, engine: EngineState, health: str | None = None) -> dict[str, Any]:
        if health is None:
            health = "unknown"
            if engine.status == "running":
                health = "healthy" if probe(engine.endpoint, "/health")[0] else "unhealthy"
        return engine.container_state(health)

    def all_container_states(self) -> list[dict[str, Any]]:
        labels = {"syshax.managed": "true", "syshax.node": self.node}
        return [self.container_state(e) for e in self.runtime.list(labels)]

    def _stop(
        self,
        deployment_id: int,
        generation: int | None,
        role: str | None,
        keep: int | None = None,
    ) -> CommandResult:
        """Stop every engine of the deployment (and role), of every generation but ``keep``.

        A stop command ignores its generation on purpose: an engine of an older generation
        still running is an orphan, and stopping it too is what the operator wants.
        """
        engines = [
            e
            for e in self._engines(deployment_id, generation, role)
            if keep is None or e.generation != keep
        ]
        # CPU engines first: they live in the GPU engine's IPC namespace.
        engines.sort(key=lambda e: e.role != "cpu")
        states = []
        for engine in engines:
            self.runtime.stop(engine.engine_id)
            gone = engine.container_state("unknown")
            gone["status"] = "missing"
            states.append(gone)
        return CommandResult(
            "succeeded",
            f"stopped {len(engines)} engine(s)",
            states,
            {"stopped": [e.name for e in engines]},
        )

    def _start(
        self, dispatch_id: str, deployment_id: int, generation: int, role: str, spec: EngineSpec
    ) -> CommandResult:
        began = time.monotonic()
        name = spec.name or engine_name(deployment_id, generation, role)
        present = self._engines(deployment_id, None, role)
        newer = sorted({e.generation for e in present if e.generation > generation})
        if newer:
            raise CommandFailed(
                f"stale command: generation {newer[-1]} of deployment {deployment_id} is already "
                f"present on this node, refusing to start generation {generation}"
            )
        for old in (e for e in present if e.generation < generation):
            # A redeploy replaces the previous generation. An old GPU engine may still host
            # its CPU engine's IPC namespace; that one goes first or the GPU one cannot.
            if role == "gpu":
                for dependent in self._engines(deployment_id, old.generation, "cpu"):
                    self.runtime.stop(dependent.engine_id)
            self.runtime.stop(old.engine_id)
        same = [e for e in present if e.generation == generation]
        running = [e for e in same if e.status == "running"]
        engine = running[0] if running else None
        for extra in (e for e in same if e is not engine):
            self.runtime.stop(extra.engine_id)  # exited leftovers, or a duplicate from a race
        peer = None
        if spec.ipc_for(role) == "peer":
            gpu = [
                e for e in self._engines(deployment_id, generation, "gpu") if e.status == "running"
            ]
            if not gpu:
                peer_name = spec.ipc_peer or engine_name(deployment_id, generation, "gpu")
                raise CommandFailed(
                    f"IPC peer GPU engine {peer_name} is not "
                    "running; the CPU engine must join its IPC namespace, start the GPU engine "
                    "first"
                )
            peer = gpu[0]
        adopted = engine is not None
        if engine is None:
            labels = engine_labels(
                node=self.node,
                deployment_id=deployment_id,
                generation=generation,
                role=role,
                dispatch_id=dispatch_id,
            )
            # Which cards the engine holds, for the heartbeat's per-card load after a restart.
            labels["syshax.accelerators"] = ",".join(a.uuid for a in spec.accelerators)
            engine = self.runtime.start(name, spec, labels, peer)
        healthy = self._wait_healthy(engine, spec, role)
        return CommandResult(
            "succeeded",
            f"{role.upper()} engine {name} is healthy",
            [healthy],
            {
                "endpoint": engine.endpoint or spec.endpoint,
                "adopted": adopted,
                "startup_seconds": round(time.monotonic() - began, 3),
            },
        )

    def _failed_log(self, engine_id: str) -> tuple[str, str, Path | None]:
        """A failed engine's log, its last lines, and where it is kept (before the engine is
        removed)."""
        log = self.runtime.logs(engine_id, LOG_KEEP_LINES)
        tail = "\n".join(log.strip().splitlines()[-LOG_TAIL_LINES:])
        return log, tail, self._keep_log(engine_id, log)

    def _keep_log(self, engine_id: str, log: str) -> Path | None:
        """A failed engine's log, kept on the node after the engine is removed (a container's
        log goes with it); the path, or None when it cannot be written."""
        try:
            self.engine_logs_dir.mkdir(parents=True, exist_ok=True)
            path = self.engine_logs_dir / f"{safe_filename(engine_id)}-{int(time.time())}.log"
            path.write_text(log, errors="replace")
            for old in sorted(self.engine_logs_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)[
                :-LOGS_KEPT
            ]:
                old.unlink(missing_ok=True)
        except OSError:
            return None
        return path

    def _wait_healthy(self, engine: EngineState, spec: EngineSpec, role: str) -> dict[str, Any]:
        deadline = time.monotonic() + spec.health_timeout_seconds
        endpoint = engine.endpoint or spec.endpoint
        paths = [spec.health_path] + ([spec.models_path] if spec.models_path else [])
        last = "not probed"
        while True:
            state = self.runtime.inspect(engine.engine_id)
            if state is None or state.status == "exited" or state.restarts > 0:
                code = state.extra.get("last_exit_code") if state else None
                log, tail, kept = self._failed_log(engine.engine_id)
                self.runtime.stop(engine.engine_id)
                what = (
                    f"exited with code {code}"
                    if code is not None
                    else "vanished"
                    if state is None
                    else "exited"
                )
                raise CommandFailed(
                    f"{role.upper()} engine {what}: {failure_story(log, tail, self.node, kept)}",
                    [engine.container_state("unhealthy") | {"status": "missing"}],
                )
            results = [probe(endpoint, p) for p in paths]
            if all(ok for ok, _ in results):
                return state.container_state("healthy")
            last = "; ".join(msg for ok, msg in results if not ok)
            if time.monotonic() >= deadline:
                _, tail, kept = self._failed_log(engine.engine_id)
                self.runtime.stop(engine.engine_id)
                where = f"full log: {self.node}:{kept} | " if kept else ""
                raise CommandFailed(
                    f"{role.upper()} engine not healthy after {spec.health_timeout_seconds:g} s "
                    f"({last}): {where}{tail}",
                    [state.container_state("unhealthy") | {"status": "missing"}],
                )
            time.sleep(self.poll_interval)
