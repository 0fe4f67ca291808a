"""Real simulator and router processes for the router's end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from common.supervisor import ReadyChild, free_port, python_argv, wait_until

ROOT = Path(__file__).resolve().parents[2]
SYSHAX = python_argv()  # the argv prefix, for tests that build their own command lines
MODEL = "m"
KV_TRANSFER_CONFIG = '{"kv_connector": "SyshaxShmConnector", "kv_role": "kv_both"}'


class Proc(ReadyChild):
    """A ``syshax`` subcommand that reports its bound port through a ready file."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        super().__init__(name, python_argv(*args), workdir, cwd=ROOT, timeout=30.0)

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

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
            # Both PD protocols on the same engines: sysHAX's fields (--syshax-compat) and
            # vLLM 0.32's SyshaxShmConnector contract (engine id and shm dir from the flags).
            "--syshax-compat",
            "--kv-transfer-config",
            KV_TRANSFER_CONFIG,
            "--enable-prompt-tokens-details",
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
    return f"http://127.0.0.1:{free_port()}"


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
    return wait_until(check, timeout, interval=interval)


__all__ = [
    "MODEL",
    "ROOT",
    "SYSHAX",
    "Proc",
    "dead_url",
    "metric",
    "os",
    "start_router",
    "start_sim",
    "wait_for",
]
