"""Fixtures that run real simulator processes on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sim_procs import MODEL, SimFactory, SimProcess, start_sim, stop_sim


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    # A private "IPC namespace" per test, so parallel test runs never see each other's segments.
    d = tmp_path / "shm"
    d.mkdir()
    return d


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[SimFactory]:
    started: list[SimProcess] = []

    def factory(
        *args: str, name: str | None = None, env: dict[str, str] | None = None
    ) -> SimProcess:
        sim = start_sim(tmp_path, name or f"sim{len(started)}", *args, env=env)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        stop_sim(sim)


@pytest.fixture(scope="module")
def gpu_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    """A GPU engine shared by the read-only API tests of a module (fast timeline)."""
    tmp = tmp_path_factory.mktemp("gpu")
    shm = tmp / "shm"
    shm.mkdir()
    sim = start_sim(
        tmp, "gpu", "--device", "a100-80gb", "--model", MODEL, "--speed", "20",
        "--max-model-len", "4096", "--shm-dir", str(shm), "--engine-id", "gpu-0",
    )  # fmt: skip
    yield sim
    stop_sim(sim)


@pytest.fixture(scope="module")
def cpu_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    tmp = tmp_path_factory.mktemp("cpu")
    shm = tmp / "shm"
    shm.mkdir()
    sim = start_sim(
        tmp, "cpu", "--device", "kunpeng-920-7280z", "--model", MODEL, "--speed", "20",
        "--shm-dir", str(shm), "--engine-id", "cpu-0",
    )  # fmt: skip
    yield sim
    stop_sim(sim)
