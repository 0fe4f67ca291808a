"""Start and stop real simulator processes on free ports (shared by the sim tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from common.supervisor import ReadyChild, python_argv

MODEL = "deepseek-r1-distill-qwen-32b"


class SimProcess(ReadyChild):
    def info(self) -> dict[str, object]:
        data: dict[str, object] = httpx.get(f"{self.url}/sim/info", timeout=5).json()
        return data


def start_sim(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> SimProcess:
    return SimProcess(name, python_argv("sim", *args), tmp, env=env, timeout=20)


def stop_sim(sim: SimProcess) -> None:
    sim.stop()


# The sim_factory fixture: start a simulator with these CLI args (stopped after the test).
SimFactory = Callable[..., SimProcess]
