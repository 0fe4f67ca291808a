"""``--workers N``: N router processes sharing one port through ``SO_REUSEPORT``.

One Python process serves requests on one core. With several workers the kernel spreads
incoming connections over N listening sockets bound to the same port, one per worker, so a
burst of new requests is parsed on several cores at once. The request path keeps no state
that must be shared: each worker scrapes the engines, counts its own in-flight sequences and
keeps its own metrics (``/metrics`` and ``/health`` describe the worker that answered).

The supervisor (this module) holds the port, starts the workers as ``syshax router`` child
processes with the same arguments, writes the ready file once all of them listen, forwards
``SIGHUP`` (policy reload) to them, restarts a worker that dies, and stops them all on
``SIGTERM``/``SIGINT``. Standalone mode only: managed workers would each register, post
stats and write the state file under the same name.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import FrameType

from common.files import write_ready_file
from common.supervisor import python_argv

log = logging.getLogger("syshax.router")

# Flags the supervisor sets itself for each worker; the rest of argv passes through.
OWN_FLAGS = ("--workers", "--port", "--ready-file", "--reuse-port")
RESTART_DELAY = 1.0


def worker_argv(argv: list[str], port: int, ready_file: str) -> list[str]:
    """``argv`` (after ``syshax``) for one worker: same options, fixed port, own ready file."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in OWN_FLAGS:
            # "--flag value" (but "--reuse-port" takes none) or "--flag=value".
            skip = "=" not in arg and name != "--reuse-port"
            continue
        out.append(arg)
    return [*out, "--port", str(port), "--ready-file", ready_file, "--reuse-port"]


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, SO_REUSEPORT socket: picks the port when ``port`` is 0 and
    keeps it ours while workers come and go. Being unlisted, it receives no connections."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    def __init__(self, argv: list[str], host: str, port: int, count: int) -> None:
        self.argv = argv
        self.count = count
        self.sock = reserve_port(host, port)
        self.port = int(self.sock.getsockname()[1])
        self.dir = Path(tempfile.mkdtemp(prefix="syshax-router-workers-"))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.stopping = False

    def _ready_file(self, index: int) -> Path:
        return self.dir / f"worker{index}.port"

    def spawn(self, index: int) -> subprocess.Popen[bytes]:
        ready = self._ready_file(index)
        ready.unlink(missing_ok=True)
        args = worker_argv(self.argv, self.port, str(ready))
        proc = subprocess.Popen(python_argv(*args))
        self.procs[index] = proc
        return proc

    def wait_ready(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        pending = set(range(self.count))
        while pending and time.monotonic() < deadline and not self.stopping:
            for index in list(pending):
                proc = self.procs[index]
                if proc is not None and proc.poll() is not None:
                    log.error("router worker %d exited at start-up (%s)", index, proc.returncode)
                    return False
                ready = self._ready_file(index)
                if ready.exists() and ready.read_text().strip():
                    pending.discard(index)
            time.sleep(0.05)
        return not pending

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    def _stop(self, _signum: int, _frame: FrameType | None) -> None:
        self.stopping = True

    def run(self, ready_file: str | None) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGHUP, self._forward)
        try:
            for index in range(self.count):
                self.spawn(index)
            if not self.wait_ready():
                return 2
            log.info("router listening on port %d with %d workers", self.port, self.count)
            if ready_file:
                write_ready_file(Path(ready_file), self.port)
            while not self.stopping:
                time.sleep(0.2)
                for index, proc in enumerate(self.procs):
                    if proc is not None and proc.poll() is not None and not self.stopping:
                        log.warning(
                            "router worker %d (pid %d) exited with %s; restarting",
                            index,
                            proc.pid,
                            proc.returncode,
                        )
                        time.sleep(RESTART_DELAY)
                        self.spawn(index)
            return 0
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + 10
        for proc in live:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.sock.close()
        for path in self.dir.glob("*"):
            path.unlink(missing_ok=True)
        self.dir.rmdir()


def supervise(argv: list[str], host: str, port: int, count: int, ready_file: str | None) -> int:
    return Supervisor(argv, host, port, count).run(ready_file)
