"""``--workers N``: several router processes on one SO_REUSEPORT port, supervised."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from router_procs import MODEL, ROOT, SYSHAX, Proc, wait_for
from test_router_paths import assert_one_continuous_stream, stream_chat

from router.workers import worker_argv

pytestmark = pytest.mark.process  # routers with --workers


def test_worker_argv_replaces_the_supervisor_flags() -> None:
    argv = ["router", "--gpu-url", "http://g", "--workers", "3", "--port=0"]
    argv += ["--ready-file", "/tmp/r", "--mode", "gpu-only"]
    assert worker_argv(argv, 7123, "/tmp/w0") == [
        "router",
        "--gpu-url",
        "http://g",
        "--mode",
        "gpu-only",
        "--port",
        "7123",
        "--ready-file",
        "/tmp/w0",
        "--reuse-port",
    ]
    # A restarted worker's argv does not pile up flags.
    again = worker_argv(worker_argv(argv, 7123, "/tmp/w0"), 7123, "/tmp/w1")
    assert again.count("--reuse-port") == 1 and again.count("--port") == 1


def child_pids(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(p) for p in text.split()}


def pids_answering(router: Proc, connections: int = 40) -> set[int]:
    """The worker pids behind ``connections`` fresh connections (the kernel spreads them)."""
    pids = set()
    for _ in range(connections):
        resp = httpx.get(router.url + "/health", timeout=10)  # a new connection each time
        assert resp.status_code == 200
        pids.add(int(resp.json()["pid"]))
    return pids


def test_workers_share_the_port_and_are_restarted(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = engines
    router = router_factory(gpu.url, cpu.url, "--mode", "gpu-only", "--workers", "2")
    workers = child_pids(router.popen.pid)
    assert len(workers) == 2
    # Connections land on both workers, never on the supervisor, and both serve streams.
    assert pids_answering(router) == workers
    for _ in range(4):
        route, chunks, _ = stream_chat(router, 6)
        assert route == "gpu-only"
        assert_one_continuous_stream(chunks, 6)

    # A worker that dies is replaced; the survivor serves meanwhile.
    victim = sorted(workers)[0]
    os.kill(victim, signal.SIGKILL)
    assert stream_chat(router, 3)[0] == "gpu-only"
    replaced = wait_for(lambda: len(child_pids(router.popen.pid) - {victim}) == 2, timeout=20)
    assert replaced
    now = child_pids(router.popen.pid)
    wait_for(lambda: pids_answering(router, 20) == now, timeout=20, interval=0.2)

    # SIGTERM to the supervisor stops every worker.
    router.popen.terminate()
    assert router.popen.wait(15) == 0
    for pid in now:
        wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), timeout=10)


def test_workers_refused_in_managed_mode(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *SYSHAX,
            *("router", "--control-plane", "http://127.0.0.1:9", "--token", "sxr_x"),
            *("--workers", "2", "--port", "0", "--state-dir", str(tmp_path)),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        text=True,
    )
    assert result.returncode == 2
    assert "standalone" in result.stderr


def test_workers_must_be_positive() -> None:
    result = subprocess.run(
        [
            *SYSHAX,
            *("router", "--gpu-url", "http://127.0.0.1:9", "--model", MODEL),
            *("--workers", "0", "--port", "0"),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        text=True,
    )
    assert result.returncode == 2 and "--workers" in result.stderr
