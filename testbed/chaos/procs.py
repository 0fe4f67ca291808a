"""The chaos stack's processes: each in its own process group, killable and restartable,
and a supervisor that restarts one that exits on its own, as docker compose does."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ProcessExit:
    """A process that exited without being told to (and was restarted)."""

    t: float  # monotonic
    name: str
    returncode: int
    last_error: str


class Proc:
    """One child in its own process group; killable and restartable. While ``held`` (killed
    on purpose) the supervisor leaves it down."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, cwd: Path
    ) -> None:
        self.name, self.argv, self.env, self.log_dir, self.cwd = name, argv, env, log_dir, cwd
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.held = True
        self.restart_pending = False
        self.lock = threading.RLock()

    def start(self) -> None:
        with self.lock:
            self.starts += 1
            log = (self.log_dir / f"{self.name}-{self.starts}.log").open("wb")
            with log:
                self.popen = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            self.held = self.restart_pending = False

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group (a gunicorn or Celery parent and its pool processes)."""
        with self.lock:
            self.held, self.restart_pending = True, False
            self.signal_group(signal.SIGKILL)
            if self.popen is not None:
                self.popen.wait(10)

    def last_error(self) -> str:
        """The last line of its log that names an error, else its last line."""
        lines = [line.strip() for line in self.log_tail(20000).splitlines() if line.strip()]
        named = [line for line in lines if re.search(r"Error|Exception|CRITICAL", line)]
        return ((named or lines or [""])[-1])[:300]

    def log_tail(self, chars: int = 3000) -> str:
        path = self.log_dir / f"{self.name}-{self.starts}.log"
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Supervisor(threading.Thread):
    """Restarts a process that exits on its own, as docker compose's ``restart:
    unless-stopped`` does for every service (docker-compose.yml), and records the exit."""

    def __init__(self, procs: dict[str, Proc], delay: float = 1.0) -> None:
        super().__init__(name="chaos-supervisor", daemon=True)
        self.procs, self.delay = procs, delay
        self.exits: list[ProcessExit] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.2):
            for proc in list(self.procs.values()):
                with proc.lock:
                    if proc.held or proc.restart_pending or proc.popen is None or proc.alive:
                        continue
                    code = proc.popen.returncode
                    self.exits.append(
                        ProcessExit(time.monotonic(), proc.name, code, proc.last_error())
                    )
                    proc.restart_pending = True
                timer = threading.Timer(self.delay, self._restart, args=(proc,))
                timer.daemon = True
                timer.start()

    def _restart(self, proc: Proc) -> None:
        with proc.lock:
            if proc.restart_pending and not proc.alive and not self.halt.is_set():
                proc.start()
