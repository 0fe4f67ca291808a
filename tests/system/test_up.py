"""`syshax up` (what `make up` runs) brings the whole system up on the embedded defaults,
serves a completion through the router from the hetero deployment, and stops cleanly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from syshax.supervisor import free_port

ROOT = Path(__file__).resolve().parents[2]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if text in cmdline and process.pid != os.getpid():
            found.append(f"{process.pid}: {cmdline[:120]}")
    return found


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def up_command(tmp_path: Path, *args: str) -> tuple[list[str], dict[str, str], list[str]]:
    """``syshax up --exit`` on free ports and the embedded defaults under ``tmp_path``:
    (argv, environment, the four ports)."""
    ports = [str(free_port()) for _ in range(4)]
    env = {
        **os.environ,
        "SYSHAX_VAR_DIR": str(tmp_path / "var"),
        "SYSHAX_ENV_FILE": str(tmp_path / "none.env"),
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
    }
    argv = [sys.executable, "-m", "syshax.cli", "up", *args, "--exit"]
    flags = ("--port", "--router-port", "--gpu-port", "--cpu-port")
    for flag, port in zip(flags, ports, strict=True):
        argv += [flag, port]
    return argv, env, ports


@pytest.mark.slow
def test_up_serves_a_completion_from_the_hetero_deployment_and_stops_cleanly(tmp_path) -> None:
    var_dir = tmp_path / "var"
    argv, env, ports = up_command(tmp_path)
    # While it runs, no process may carry a machine token on its command line.
    exposed: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            exposed.extend(processes_mentioning("sxa_") + processes_mentioning("sxr_"))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
        )
    finally:
        done.set()
        watcher.join()
    assert exposed == []
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "start-gpu: GPU engine" in output and "start-cpu: CPU engine" in output
    assert output.index("start-gpu:") < output.index("start-cpu:")
    assert "completion through the router:" in output
    assert "admin user admin / " in output
    assert "stopped." in output
    assert processes_mentioning(str(var_dir)) == []
    for port in ports:  # web, router and both engines are gone
        assert not listening(int(port)), f"port {port} still served after shutdown"
    # A second run reuses the state: no new admin password, same node.
    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "admin user admin / " not in again.stdout
    assert "completion through the router:" in again.stdout
    assert processes_mentioning(str(var_dir)) == []
