"""Start and stop real simulator processes on free ports (shared by the sim tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL = "deepseek-r1-distill-qwen-32b"


@dataclass
class SimProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def info(self) -> dict[str, object]:
        data: dict[str, object] = httpx.get(f"{self.url}/sim/info", timeout=5).json()
        return data


def start_sim(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> SimProcess:
    ready = tmp / f"{name}.port"
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "syshax.cli", "sim", "--port", "0", "--ready-file", str(ready)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    deadline = time.monotonic() + 20
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"simulator {name} did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return SimProcess(proc=proc, port=int(ready.read_text()), log=log)


def stop_sim(sim: SimProcess) -> None:
    sim.proc.terminate()
    try:
        sim.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        sim.proc.kill()
        sim.proc.wait()


# The sim_factory fixture: start a simulator with these CLI args (stopped after the test).
SimFactory = Callable[..., SimProcess]
