"""A small process supervisor for ``syshax up``: start children, stop them all cleanly.

Each child runs in its own process group so Ctrl-C, SIGTERM or a crash of one child stops
every process it started too (gunicorn workers, celery pool processes, engines).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None


class Supervisor:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.log_dir / f"{name}.log", env or {})
        child.log_file = child.log_path.open("ab")
        child.process = subprocess.Popen(
            argv,
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **child.env},
            start_new_session=True,
        )
        self.children.append(child)
        return child

    def first_exited(self) -> Child | None:
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                return child
        return None

    def stop_all(self, timeout: float = 15.0) -> None:
        """SIGTERM every child (last started first) so each shuts its own workers down, then
        SIGKILL whatever is left in its process group."""
        for child in reversed(self.children):
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            if child.process is None:
                continue
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.process.wait(remaining)
            except subprocess.TimeoutExpired:
                self._signal(child, signal.SIGKILL)
                child.process.wait(5)
            # Kill anything the child left behind in its group (e.g. pool processes).
            self._signal(child, signal.SIGKILL)
            if child.log_file is not None:
                child.log_file.close()

    @staticmethod
    def _signal(child: Child, sig: int) -> None:
        if child.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, sig)

    def tail(self, child: Child, lines: int = 20) -> str:
        try:
            text = child.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def python_argv(*args: str) -> list[str]:
    """Run a syshax subcommand with the current interpreter (works without the console script)."""
    return [sys.executable, "-m", "syshax.cli", *args]
