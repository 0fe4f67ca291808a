#!/usr/bin/env python3
"""How long the agent takes to bring a hetero deployment up and down, per runtime.

One deploy = start the GPU engine and wait until it is healthy, then start the CPU engine in
its IPC namespace and wait until it is healthy; then stop both. Both engines are `syshax sim`.
The process runtime and the Docker-API runtime (Podman's compat service, set up by
scripts/dev/podman_setup.sh) are measured side by side in one run, alternating, and the medians
and their ratio are printed.

    .venv/bin/python scripts/bench/agent_deploy_timing.py [--runs 5] [--no-docker]

This is the agent's share of a deploy. The control plane's share (Celery hops, REST result,
DB writes) shows in tests/agents/test_agent_e2e.py, which prints the end-to-end time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agents.commands import CommandExecutor  # noqa: E402
from agents.engine_policy import EnginePolicy  # noqa: E402
from agents.runtimes import Runtime  # noqa: E402
from agents.runtimes.process import ProcessRuntime  # noqa: E402
from common.engine_spec import Mount  # noqa: E402
from common.supervisor import free_port  # noqa: E402

IMAGE = "localhost/syshax-hostroot:1"
# What the tiny image needs of the host, read-only: its Python and this project.
HOST_PATHS = sorted({Path("/usr"), Path(sys.base_prefix).resolve(), ROOT})
# An agent's policy with those --mounts and --allow-image for the image (docs/agent.md).
POLICY = EnginePolicy(
    mounts=tuple(Mount(str(p), str(p)) for p in HOST_PATHS), allow_images=(IMAGE,)
)


def sim_spec(device: str, container: bool, **extra: Any) -> dict[str, Any]:
    port = free_port()
    spec: dict[str, Any] = {
        "command": [sys.executable, "-m", "syshax.cli", "sim"],
        "args": [
            "--device",
            device,
            "--model",
            "qwen2.5-7b-instruct",
            "--port",
            str(port),
            "--speed",
            "50",
        ],
        "port": port,
        "health_timeout_seconds": 60,
        **extra,
    }
    if container:
        spec["image"] = IMAGE
        spec["mounts"] = [{"source": str(p), "target": str(p)} for p in HOST_PATHS]
    return spec


def one_deploy(executor: CommandExecutor, container: bool, deployment_id: int) -> dict[str, float]:
    def command(action: str, role: str | None, spec: dict[str, Any] | None) -> dict[str, Any]:
        result = executor.execute(
            dispatch_id=str(uuid.uuid4()),
            action=action,
            deployment_id=deployment_id,
            generation=1,
            role=role,
            spec=spec,
        )
        if result["status"] != "succeeded":
            raise SystemExit(f"{action} {role} failed: {result['detail']}")
        return result

    t0 = time.perf_counter()
    command("start", "gpu", sim_spec("a100-80gb", container, shm_size_bytes=256 << 20))
    t1 = time.perf_counter()
    command("start", "cpu", sim_spec("xeon-8480", container))
    t2 = time.perf_counter()
    command("stop", None, {})
    t3 = time.perf_counter()
    return {"gpu_healthy": t1 - t0, "cpu_healthy": t2 - t1, "deploy": t2 - t0, "stop": t3 - t2}


def start_podman(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    out = subprocess.run(
        [str(ROOT / "scripts/dev/podman_setup.sh")], capture_output=True, text=True, check=True
    ).stdout
    env = {**os.environ, **dict(line.split("=", 1) for line in out.splitlines() if "=" in line)}
    sock = tmp / "podman.sock"
    proc = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("podman service did not start")
        time.sleep(0.1)
    return proc, f"unix://{sock}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-docker", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="agent-timing-"))
    runtimes: dict[str, Runtime] = {"process": ProcessRuntime(tmp / "proc")}
    podman = None
    if not args.no_docker:
        from agents.runtimes.dockerapi import DockerRuntime

        podman, url = start_podman(tmp)
        runtimes["docker"] = DockerRuntime(url)
    try:
        results: dict[str, list[dict[str, float]]] = {name: [] for name in runtimes}
        for i in range(args.runs):
            for name, runtime in runtimes.items():  # alternate so drift hits both alike
                executor = CommandExecutor(
                    runtime, node="bench", state_dir=tmp / f"s-{name}", policy=POLICY
                )
                results[name].append(one_deploy(executor, name == "docker", 900 + i))
        print(
            f"agent deploy timing, {args.runs} runs each, medians in seconds "
            "(GPU sim a100-80gb then CPU sim xeon-8480, both healthy; then stop)"
        )
        keys = ["gpu_healthy", "cpu_healthy", "deploy", "stop"]
        print(f"{'runtime':<10}" + "".join(f"{k:>13}" for k in keys))
        med = {
            n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in results.items()
        }
        for name, m in med.items():
            print(f"{name:<10}" + "".join(f"{m[k]:>13.3f}" for k in keys))
        if "docker" in med:
            print(
                f"{'ratio d/p':<10}"
                + "".join(f"{med['docker'][k] / med['process'][k]:>13.2f}" for k in keys)
            )
    finally:
        if podman is not None:
            podman.terminate()
            podman.wait(15)


if __name__ == "__main__":
    main()
