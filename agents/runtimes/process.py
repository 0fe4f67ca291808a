"""The process runtime: engines as local processes, for ``syshax up`` and container-less hosts.

Each engine runs under :mod:`agents.runtimes.launcher` in its own session, so it outlives the
agent. Its labels live in ``<state-dir>/engines/<engine_id>.json``; a restarted agent lists that
directory and re-adopts what is still alive (the PID and its start time must both match, so a
recycled PID is never mistaken for our engine). An engine's environment is a few of the
agent's variables plus its spec's (agents/engine_policy/environment.py), never the agent's
token.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from agents.engine_policy.environment import engine_base_env
from agents.runtimes import EngineRuntimeError, EngineState
from common.affinity import AffinityError, parse_cpu_list
from common.engine_spec import EngineSpec, kv_connector_dir, prepend_python_path
from common.files import write_json_atomic


class ProcessRuntime:
    name = "process"

    def __init__(
        self, state_dir: str | Path, python: str = sys.executable, pass_env: Sequence[str] = ()
    ) -> None:
        self.state_dir = Path(state_dir)
        self.engines_dir = self.state_dir / "engines"
        self.logs_dir = self.state_dir / "logs"
        self.engines_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.pass_env = tuple(pass_env)  # the agent's --pass-env names
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------ records

    def _record_path(self, engine_id: str) -> Path:
        return self.engines_dir / f"{engine_id}.json"

    def _load(self, engine_id: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._record_path(engine_id).read_text())
        except (OSError, ValueError):
            return None
        return data

    def _save(self, record: dict[str, Any]) -> None:
        write_json_atomic(self._record_path(record["engine_id"]), record)

    def _alive(self, record: Mapping[str, Any]) -> bool:
        pid = int(record["pid"])
        child = self._children.get(pid)
        if child is not None and child.poll() is not None:
            return False  # ours and reaped
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - float(record["create_time"])) > 0.5:
                return False
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    # ------------------------------------------------------------ Runtime

    def start(
        self, name: str, spec: EngineSpec, labels: Mapping[str, str], ipc_peer: EngineState | None
    ) -> EngineState:
        if not spec.command:
            raise EngineRuntimeError(
                "spec.command: the process runtime has no image entrypoint; give the full argv"
            )
        cpus: set[int] | None = None
        if spec.cpuset:
            try:
                cpus = set(parse_cpu_list(spec.cpuset, field_name="cpuset"))
            except AffinityError as exc:
                raise EngineRuntimeError(str(exc)) from None
            usable = os.sched_getaffinity(0)
            if not cpus <= usable:
                raise EngineRuntimeError(
                    f"cpuset {spec.cpuset} is not available here (usable CPUs: {sorted(usable)})"
                )
        engine_id = f"proc-{uuid.uuid4().hex[:12]}"
        exit_file = self.engines_dir / f"{engine_id}.exit"
        log_path = self.logs_dir / f"{name}.log"
        # Never the agent's whole environment: its token and settings stay with it.
        env = {**engine_base_env(os.environ, self.pass_env), **spec.env}
        if spec.kv_connector:
            env = prepend_python_path(env, str(kv_connector_dir()))
        argv = [
            self.python,
            "-m",
            "agents.runtimes.launcher",
            str(exit_file),
            spec.restart_policy,
            "--",
            *spec.argv,
        ]
        with open(log_path, "ab") as log:
            try:
                child = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=spec.working_dir,
                    start_new_session=True,
                    # The cpuset is applied before exec so every engine thread inherits it.
                    preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
                )
            except OSError as exc:
                raise EngineRuntimeError(f"cannot start {spec.argv[0]!r}: {exc}") from None
        self._children[child.pid] = child
        record = {
            "engine_id": engine_id,
            "name": name,
            "labels": dict(labels),
            "pid": child.pid,
            "create_time": psutil.Process(child.pid).create_time(),
            "argv": spec.argv,
            "log": str(log_path),
            "exit_file": str(exit_file),
            "endpoint": spec.endpoint,
            "cpuset": spec.cpuset,
            "ipc_peer": ipc_peer.engine_id if ipc_peer else None,
        }
        self._save(record)
        state = self.inspect(engine_id)
        assert state is not None
        return state

    def inspect(self, engine_id: str) -> EngineState | None:
        record = self._load(engine_id)
        return None if record is None else self._state(engine_id, record)

    def _state(self, engine_id: str, record: dict[str, Any]) -> EngineState:
        exit_info: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            exit_info = json.loads(Path(record["exit_file"]).read_text())
        alive = self._alive(record)
        exit_code = exit_info.get("exit_code")
        if not alive and exit_code is None:
            child = self._children.get(int(record["pid"]))
            exit_code = child.returncode if child is not None else None
        return EngineState(
            engine_id=engine_id,
            name=record["name"],
            labels=record["labels"],
            status="running" if alive else "exited",
            exit_code=None if alive else exit_code,
            restarts=int(exit_info.get("restarts", 0)),
            endpoint=record.get("endpoint"),
            extra={
                "pid": record["pid"],
                "log": record["log"],
                "last_exit_code": exit_info.get("last_exit_code", exit_code),
            },
        )

    def stop(self, engine_id: str, timeout: float = 10.0) -> None:
        record = self._load(engine_id)
        if record is None:
            return
        pid = int(record["pid"])
        if self._alive(record):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # the launcher forwards it to the engine
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self._alive(record):
                time.sleep(0.05)
            if self._alive(record):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        child = self._children.pop(pid, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)
        for path in (self._record_path(engine_id), Path(record["exit_file"])):
            path.unlink(missing_ok=True)

    def logs(self, engine_id: str, tail: int = 50) -> str:
        record = self._load(engine_id)
        if record is None:
            return ""
        try:
            with open(record["log"], "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-tail:])

    def list(self, labels: Mapping[str, str]) -> list[EngineState]:
        out = []
        for path in sorted(self.engines_dir.glob("*.json")):
            # Labels first: the full state probes the process and reads its exit file.
            record = self._load(path.stem)
            if record is not None and all(record["labels"].get(k) == v for k, v in labels.items()):
                out.append(self._state(path.stem, record))
        return out
