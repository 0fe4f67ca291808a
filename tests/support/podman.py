"""Podman's Docker-compatible API service on a private socket, for tests that need a real
Docker-API engine (the agent's docker runtime, docker compose)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.supervisor import wait_until


@contextmanager
def podman_service(env_vars: dict[str, str], workdir: Path) -> Iterator[Path]:
    """`podman system service` on ``workdir/podman.sock`` with ``env_vars`` (the setup script's
    CONTAINERS_CONF and friends); its output goes to ``workdir/service.log``; stopped on exit."""
    sock = workdir / "podman.sock"
    with open(workdir / "service.log", "wb") as log:
        service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{sock}"],
            env={**os.environ, **env_vars},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: sock.exists() or service.poll() is not None,
            30,
            "the podman socket",
            interval=0.1,
        )
        assert service.poll() is None, (workdir / "service.log").read_text()
        yield sock
    finally:
        service.terminate()
        try:
            service.wait(timeout=20)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
