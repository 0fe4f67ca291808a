"""Fixtures: real simulated engines (shared per module) and a fresh router per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from router_procs import Proc, start_router, start_sim


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("router")
    (path / "shm").mkdir()
    return path


@pytest.fixture(scope="module")
def engines(workdir: Path) -> Iterator[tuple[Proc, Proc]]:
    """One GPU and one CPU engine sharing a KV handoff directory, 20x faster than real."""
    gpu = start_sim("gpu", "h100-80gb", workdir, workdir / "shm", 20)
    try:
        cpu = start_sim("cpu", "kunpeng-920-7280z", workdir, workdir / "shm", 20)
    except Exception:
        gpu.stop()
        raise
    yield gpu, cpu
    cpu.stop()
    gpu.stop()


@pytest.fixture
def router_factory(workdir: Path) -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []
    counter = iter(range(10_000))

    def make(gpu: str, cpu: str | None, *extra: str) -> Proc:
        proc = start_router(f"router{next(counter)}", workdir, gpu, cpu, *extra)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def slow_cpu(workdir: Path) -> Iterator[Proc]:
    """A CPU engine of its own (tests kill it), slow enough to act mid-stream."""
    proc = start_sim("slowcpu", "kunpeng-920-7280z", workdir, workdir / "shm", 2)
    yield proc
    proc.stop()
