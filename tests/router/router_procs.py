"""Real simulator and router processes for the router's end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
SYSHAX = [sys.executable, "-m", "syshax.cli"]
MODEL = "m"


class Proc:
    """A child process that reports its bound port through a ready file."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.ready_file = workdir / f"{name}.port"
        self.log_path = workdir / f"{name}.log"
        self.ready_file.unlink(missing_ok=True)
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [*SYSHAX, *args, "--port", "0", "--ready-file", str(self.ready_file)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        self.port = self._wait_ready()
        self.url = f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                text = self.ready_file.read_text().strip()
                if text:
                    return int(text)
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_text()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not ready in {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL: the engine dies without closing anything cleanly."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self.log.close()

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)


def start_sim(name: str, device: str, workdir: Path, shm: Path, speed: float, *extra: str) -> Proc:
    return Proc(
        name,
        [
            "sim",
            "--device",
            device,
            "--model",
            "deepseek-r1-distill-qwen-32b",
            "--served-model-name",
            MODEL,
            "--speed",
            str(speed),
            "--shm-dir",
            str(shm),
            "--engine-id",
            name,
            "--seed",
            "7",
            "--log-level",
            "WARNING",
            *extra,
        ],
        workdir,
    )


def start_router(name: str, workdir: Path, gpu: str, cpu: str | None, *extra: str) -> Proc:
    args = ["router", "--gpu-url", gpu, "--model", MODEL, "--log-level", "INFO"]
    if cpu:
        args += ["--cpu-url", cpu]
    return Proc(name, [*args, *extra], workdir)


def dead_url() -> str:
    """A URL on which nothing listens (bound then closed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def metric(proc: Proc, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in proc.get("/metrics").text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_for(check: Any, timeout: float = 5.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")


__all__ = ["MODEL", "Proc", "dead_url", "metric", "os", "start_router", "start_sim", "wait_for"]
