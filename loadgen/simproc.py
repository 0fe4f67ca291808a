"""Run ``syshax sim`` engines and ``syshax router`` as child processes, for the scripts,
tests and docs figures."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from common.policy_schema import PolicyKnobs
from common.supervisor import ChildStartError, ReadyChild, python_argv

DEFAULT_MODEL = "deepseek-r1-distill-qwen-32b"


# The knobs that change with the speed (below); the rest mean the same at any speed.
SPEED_SCALED_KNOBS = (
    "metrics_interval_seconds",
    "request_timeout_seconds",
    "cpu_throughput_threshold",
)


def knob_flags_for_speed(
    knobs: PolicyKnobs, speed: float, *, only: Collection[str] | None = None
) -> list[str]:
    """Router flags setting ``knobs`` for engines that run ``speed`` times faster than real
    time.

    Three kinds of knob meet a simulator differently:

    - latencies the router reads from the engine's own metrics (``cpu_decode_slo_ms`` and
      ``gpu_decode_slo_ms`` against the ITL histogram) are in simulated seconds already, as
      every duration the simulator reports is: they are not scaled;
    - the router's own clocks (``metrics_interval_seconds``, ``request_timeout_seconds``)
      run in wall time: divided by the speed;
    - throughput the router measures itself, as tokens between two scrapes over wall time
      (``cpu_throughput_threshold``): multiplied by the speed.

    ``only`` restricts the flags to those knobs.
    """
    flags: list[str] = []
    for name, value in knobs.as_dict().items():
        if only is not None and name not in only:
            continue
        if speed != 1.0 and name == "metrics_interval_seconds":
            value = max(value / speed, 0.1)
        elif speed != 1.0 and name == "request_timeout_seconds":
            value = value / speed
        elif speed != 1.0 and name == "cpu_throughput_threshold":
            value = value * speed
        if isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, str):
            text = value
        else:
            text = f"{value:g}"
        flags += ["--" + name.replace("_", "-"), text]
    return flags


# The simulator (or router) exited or did not report its port in time.
SimStartError = ChildStartError


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
        command = python_argv(
            "sim", "--device", device, "--model", model,
            "--speed", str(speed), "--seed", str(seed), *extra_args,
        )  # fmt: skip
        with ReadyChild("sim", command, Path(tmp), cpus=cpus, timeout=startup_timeout_s) as sim:
            yield sim.url


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
        command = python_argv(
            "router", "--gpu-url", gpu_url, "--cpu-url", cpu_url, "--mode", mode, *extra_args
        )
        with ReadyChild("router", command, Path(tmp), timeout=startup_timeout_s) as router:
            yield router.url
