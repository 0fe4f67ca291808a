"""A small process supervisor for ``syshax up``: start children, stop them all cleanly.

Each child runs in its own process group so Ctrl-C, SIGTERM or a crash of one child stops
every process it started too (gunicorn workers, celery pool processes, engines).

Also the one place that starts a syshax child with ``--ready-file`` and waits for its port
(:class:`ReadyChild`), polls for a condition (:func:`wait_until`) and picks a free port, for
the commands, agents, router, tests and scripts alike (atomic file writes are
:mod:`common.files`). Django-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

from common.files import read_ready_port

T = TypeVar("T")


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


class WaitTimeout(AssertionError, RuntimeError):
    """:func:`wait_until` ran out of time. An AssertionError so a test fails as a failed check,
    a RuntimeError so ``syshax up`` reports it like its other start-up errors."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str = "condition",
    *,
    interval: float = 0.1,
    alive: Callable[[], None] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that.

    ``alive`` is called before each poll; it raises to give up early (e.g. a child died).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {what}")


def free_port() -> int:
    """A TCP port nothing listens on right now (bound to port 0, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ChildStartError(RuntimeError):
    """A ready-file child exited or did not report its port in time."""


class ReadyChild:
    """A child started with ``--port 0 --ready-file F`` that is ready once it writes its port.

    ``argv`` is the full command line (without those two flags, which are appended). Output
    goes to ``workdir/<name>.log``; the ready file is ``workdir/<name>.port``. ``cpus`` pins
    the child to those cores (Linux). On exit or timeout the child is stopped and
    :class:`ChildStartError` carries the tail of its log.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        cpus: Collection[int] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.name = name
        self.ready_file = workdir / f"{name}.port"
        self.log_path = workdir / f"{name}.log"
        self.ready_file.unlink(missing_ok=True)
        pinned = set(cpus) if cpus else None

        def pin() -> None:
            if pinned:
                os.sched_setaffinity(0, pinned)

        command = [*argv, "--port", "0", "--ready-file", str(self.ready_file)]
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env} if env else None,
                cwd=cwd,
                preexec_fn=pin if pinned else None,
            )
        self.port = self._wait_ready(timeout)
        self.url = f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        port = read_ready_port(self.ready_file)
        while port is None:
            if self.popen.poll() is not None:
                raise ChildStartError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.log_text()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ChildStartError(
                    f"{self.name} gave no port within {timeout} s:\n{self.log_text()}"
                )
            time.sleep(0.05)
            port = read_ready_port(self.ready_file)
        return port

    def log_text(self, chars: int = 4000) -> str:
        """The end of the child's output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the child dies without closing anything cleanly."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def __enter__(self) -> ReadyChild:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
