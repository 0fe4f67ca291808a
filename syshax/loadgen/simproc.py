"""Run ``syshax sim`` engines and ``syshax router`` as child processes, for the scripts,
tests and docs figures."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

DEFAULT_MODEL = "deepseek-r1-distill-qwen-32b"


class SimStartError(RuntimeError):
    """The simulator (or router) exited or did not report its port in time."""


def _read_port(ready: Path) -> int | None:
    try:
        text = ready.read_text().strip()
    except FileNotFoundError:
        return None
    if not text:
        return None
    if text.isdigit():
        return int(text)
    try:
        document = json.loads(text)
    except ValueError:
        return None  # still being written
    if isinstance(document, int):
        return document
    if isinstance(document, dict) and isinstance(document.get("port"), int):
        return int(document["port"])
    return None


@contextlib.contextmanager
def running_sim(
    device: str,
    model: str = DEFAULT_MODEL,
    *,
    speed: float = 1.0,
    seed: int = 0,
    cpus: Collection[int] | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Start a simulated engine on an ephemeral port; yield its base URL; stop it after.

    ``cpus`` pins the engine to those cores (Linux), so a generator pinned elsewhere does
    not share a core with it.
    """
    with tempfile.TemporaryDirectory(prefix="syshax-sim-") as tmp:
        ready = Path(tmp) / "ready"
        log_path = Path(tmp) / "sim.log"
        command = [
            sys.executable, "-m", "syshax.cli", "sim",
            "--device", device, "--model", model,
            "--port", "0", "--ready-file", str(ready),
            "--speed", str(speed), "--seed", str(seed),
            *extra_args,
        ]  # fmt: skip
        pinned = set(cpus) if cpus else None
        with _started(command, ready, log_path, pinned, startup_timeout_s) as port:
            yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def _started(
    command: list[str],
    ready: Path,
    log_path: Path,
    cpus: set[int] | None,
    startup_timeout_s: float,
) -> Iterator[int]:
    """Run ``command`` until the block ends; yield the port it writes to ``ready``."""

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)
    try:
        deadline = time.monotonic() + startup_timeout_s
        port = _read_port(ready)
        while port is None:
            if process.poll() is not None:
                output = log_path.read_text(errors="replace")[-2000:]
                raise SimStartError(f"{command[3]} exited with {process.returncode}:\n{output}")
            if time.monotonic() > deadline:
                raise SimStartError(f"{command[3]} gave no port within {startup_timeout_s} s")
            time.sleep(0.05)
            port = _read_port(ready)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def fetch_sim_requests(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """The engine's own per-request timings (``GET /sim/requests``)."""
    async with session.get(f"{base_url.rstrip('/')}/sim/requests") as response:
        response.raise_for_status()
        document = await response.json()
    if not isinstance(document, dict):
        raise ValueError("/sim/requests did not answer a JSON object")
    return document


@contextlib.contextmanager
def running_router(
    gpu_url: str,
    cpu_url: str,
    *,
    mode: str,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Start ``syshax router`` standalone in front of two engines, its policy mode forced."""
    with tempfile.TemporaryDirectory(prefix="syshax-router-") as tmp:
        ready = Path(tmp) / "ready"
        log_path = Path(tmp) / "router.log"
        command = [
            sys.executable, "-m", "syshax.cli", "router",
            "--gpu-url", gpu_url, "--cpu-url", cpu_url, "--mode", mode,
            "--port", "0", "--ready-file", str(ready), *extra_args,
        ]  # fmt: skip
        with _started(command, ready, log_path, None, startup_timeout_s) as port:
            yield f"http://127.0.0.1:{port}"
