"""Helpers shared by the agent tests (a uniquely named module: every test dir has a conftest)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from common.supervisor import free_port


def http_engine_spec(root: Path, **extra: Any) -> dict[str, Any]:
    """An engine spec serving ``root`` with ``python -m http.server`` on a free port."""
    port = free_port()
    spec: dict[str, Any] = {
        "command": [
            sys.executable,
            "-m",
            "http.server",
            str(port),
            "--bind",
            "127.0.0.1",
            "--directory",
            str(root),
        ],
        "port": port,
        "health_timeout_seconds": 20,
    }
    spec.update(extra)
    return spec


def sim_spec(**extra: Any) -> dict[str, Any]:
    """A simulator engine as the control plane issues it (the agent's interpreter running
    ``-m syshax.cli sim``): the agent's default policy runs it."""
    port = free_port()
    args = ["--device", "a100-80gb", "--model", "qwen2.5-7b-instruct", "--port", str(port)]
    command = [sys.executable, "-m", "syshax.cli", "sim"]
    return {"command": command, "args": args, "port": port, "health_timeout_seconds": 20, **extra}


PROJECT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/syshax-hostroot:1"  # built by scripts/dev/podman_setup.sh


def host_mounts(*extra: Path) -> list[dict[str, object]]:
    """Bind mounts that let the tiny image run this host's Python, venv and project read-only."""
    paths = {Path("/usr"), Path(sys.base_prefix).resolve(), PROJECT, *extra}
    return [{"source": str(p), "target": str(p), "read_only": True} for p in sorted(paths)]
