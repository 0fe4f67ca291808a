"""Print the heartbeat figures a node agent reports for a simulated card, window by window.

Starts one `syshax sim` engine (A100, the q4 32B model, --speed 10), reads its /sim/info with
the agent's own SimulatedLoadReader every 0.5 s wall, and drives it idle -> six long requests
-> idle -> one short stream. Usage: .venv/bin/python scripts/bench/sim_card_load.py
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import httpx

from agents.discovery import EngineOnCards, SimulatedLoadReader
from common.supervisor import ReadyChild, python_argv

WINDOW_S = 0.5


def start_engine(tmp: Path) -> ReadyChild:
    argv = python_argv(
        "sim", "--device", "a100-80gb", "--model", "deepseek-r1-distill-qwen-32b",
        "--speed", "10",
    )  # fmt: skip
    return ReadyChild("sim", argv, tmp)


def requests(url: str, count: int, words: int, max_tokens: int) -> list[threading.Thread]:
    def one() -> None:
        httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "w " * words, "max_tokens": max_tokens},
            timeout=120,
        )

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def main() -> int:
    engine = start_engine(Path(tempfile.mkdtemp(prefix="sim-card-load-")))
    url = engine.url
    reader = SimulatedLoadReader()
    engines = [EngineOnCards("demo", url, ("SIM-card",))]

    def window(tag: str) -> None:
        time.sleep(WINDOW_S)
        load = reader.read(engines)["SIM-card"]
        print(
            f"{tag:22s} utilisation {load.utilization_percent:5.1f} %   "
            f"memory {load.memory_used_bytes / 2**30:6.2f} GiB"
        )

    try:
        reader.read(engines)
        window("idle")
        busy = requests(url, count=6, words=1000, max_tokens=600)
        for i in range(4):
            window(f"6 x 1000+600 tok, w{i}")
        for t in busy:
            t.join()
        window("idle again")
        short = requests(url, count=1, words=40, max_tokens=200)
        window("one 200-token stream")
        short[0].join()
    finally:
        reader.close()
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
