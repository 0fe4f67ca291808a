"""Throwaway Redis and PostgreSQL servers of a test's own, on free ports in temp directories.

Nothing here touches the shared services on 5432/6379: each server is a new process with its
own data directory, and :meth:`kill`, :meth:`pause` and :meth:`restart` act on that process
only (the chaos suite, testbed/chaos, uses them to crash and revive a broker or a database).

    with throwaway_redis() as redis, throwaway_postgres() as pg:
        env = {"REDIS_URL": redis.url, "DATABASE_URL": pg.create_database("syshax")}

The binaries come from ``PATH`` (``redis-server``; ``initdb``, ``pg_ctl``, ``createdb``) or,
for PostgreSQL, the newest ``/usr/lib/postgresql/*/bin``. PostgreSQL refuses to run as root,
so as root the cluster is created and started as the ``postgres`` user (``runuser``), in a
directory that user owns. :func:`missing_binaries` says what is absent, for a caller that must
fail loudly (CI) rather than skip.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from common.supervisor import free_port, wait_until

POSTGRES_USER = "postgres"  # the cluster's superuser, and the OS user as root


class ServiceUnavailable(RuntimeError):
    """A binary is missing or a server did not come up."""


def postgres_bin_dir() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``: from PATH, else the newest Debian one."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for candidate in reversed(candidates):
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    return None


def missing_binaries() -> list[str]:
    """What is absent of ``redis-server``, ``initdb``/``pg_ctl`` and, as root, ``runuser``
    with a ``postgres`` user."""
    missing = []
    if shutil.which("redis-server") is None:
        missing.append("redis-server")
    if postgres_bin_dir() is None:
        missing.append("initdb/pg_ctl (PostgreSQL server binaries)")
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            missing.append("runuser (to run PostgreSQL as a non-root user)")
        try:
            pwd.getpwnam(POSTGRES_USER)
        except KeyError:
            missing.append(f"a {POSTGRES_USER!r} OS user (PostgreSQL refuses root)")
    return missing


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """``redis-server`` on 127.0.0.1:``port`` with no persistence: a restart starts empty,
    as a crashed broker without a disk would."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.log_path = workdir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout: float = 20.0) -> None:
        argv = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.starts += 1
        process = self.process

        def alive() -> None:
            if process.poll() is not None:
                raise ServiceUnavailable(f"redis-server exited:\n{self.log_tail()}")

        wait_until(
            lambda: _answers_ping(self.port), timeout, "redis-server", interval=0.05, alive=alive
        )

    def kill(self) -> None:
        """SIGKILL: everything it held is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Start again on the same port (after :meth:`kill`)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class PostgresServer:
    """A PostgreSQL cluster of its own: ``initdb`` in ``workdir/data``, listening on
    127.0.0.1:``port`` and a socket in ``workdir``, trust authentication, superuser
    ``postgres``. ``fsync=off``: a killed server loses nothing the kernel already has, and only
    an OS crash would lose more (the suite never crashes the OS)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise ServiceUnavailable("PostgreSQL server binaries (initdb, pg_ctl) not found")
        self.bin_dir = bin_dir
        self.workdir = workdir
        self.port = port or free_port()
        self.data_dir = workdir / "data"
        self.log_path = workdir / "postgres.log"
        self.as_user = POSTGRES_USER if os.geteuid() == 0 else None
        self.starts = 0

    def url(self, database: str = "postgres") -> str:
        return f"postgres://{POSTGRES_USER}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = 120.0) -> str:
        command = [str(self.bin_dir / argv[0]), *argv[1:]]
        if self.as_user:
            command = ["runuser", "-u", self.as_user, "--", *command]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=self.workdir
        )
        if result.returncode != 0:
            raise ServiceUnavailable(
                f"{' '.join(argv[:2])} failed ({result.returncode}):\n{result.stdout}"
                f"{result.stderr}\n{self.log_tail()}"
            )
        return result.stdout

    def init(self) -> None:
        if self.as_user:
            entry = pwd.getpwnam(self.as_user)
            os.chown(self.workdir, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb",
            "-D",
            str(self.data_dir),
            "--username",
            POSTGRES_USER,
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--no-sync",
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        data, log = str(self.data_dir), str(self.log_path)
        self._run("pg_ctl", "-D", data, "-l", log, "-o", options, "-w", "-t", "60", "start")
        self.starts += 1

    @property
    def pid(self) -> int | None:
        """The postmaster's PID (first line of postmaster.pid), or None when not running."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend at once, as a crashed host would: the next
        :meth:`start` runs crash recovery from the WAL."""
        pid = self.pid
        if pid is None:
            return
        try:
            processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(processes, timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.pid is None:
            return
        try:
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
        except ServiceUnavailable:
            self.kill()

    def create_database(self, name: str) -> str:
        """Create ``name`` and return its URL."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", POSTGRES_USER, name)
        return self.url(name)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _scratch(prefix: str) -> Path:
    # Its own top-level temp directory: as root the ``postgres`` user must reach it, and a
    # pytest tmp_path (mode 0700, owned by root) is out of its reach.
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


@contextmanager
def throwaway_redis(port: int | None = None) -> Iterator[RedisServer]:
    """A started :class:`RedisServer`; stopped and its directory removed afterwards."""
    if shutil.which("redis-server") is None:
        raise ServiceUnavailable("redis-server not found on PATH")
    workdir = _scratch("syshax-redis-")
    server = RedisServer(workdir, port)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def throwaway_postgres(port: int | None = None) -> Iterator[PostgresServer]:
    """An initialised and started :class:`PostgresServer`; stopped and removed afterwards."""
    workdir = _scratch("syshax-pg-")
    try:
        server = PostgresServer(workdir, port)
        server.init()
        server.start()
        try:
            yield server
        finally:
            server.stop()
            # A server killed and never restarted may leave backends for a moment.
            deadline = time.monotonic() + 10
            while server.pid is not None and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
