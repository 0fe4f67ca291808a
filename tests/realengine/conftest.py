"""The real-engine tier: two real vLLM 0.32 engines on this machine's CPU (one in the GPU
role, one in the CPU role), started once for the whole package, with the SyshaxShmConnector
in both and one shared shm directory (the shared IPC namespace of a real deployment).

vLLM is installed into its own virtualenv on first use (tests/realengine/vllm_env.py). A
machine where that fails fails these tests: they are never skipped.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from syshax.supervisor import free_port
from tests.realengine.vllm_env import VllmEngine, connector_config, ensure_tiny_model, ensure_vllm
from tests.router.router_procs import Proc

# Each connector reaps expired segments; a short lease keeps the lease tests short.
LEASE_SECONDS = 4
# The router's policy file: PD for every request, a re-decision every 16 tokens.
FORCED_PD = {"mode": "forced-pd", "token_limit_min": 16, "token_limit_max": 16}


@dataclass
class Pair:
    gpu: VllmEngine
    cpu: VllmEngine
    shm: Path
    workdir: Path


@pytest.fixture(scope="package")
def engines() -> Iterator[Pair]:
    ensure_vllm()
    ensure_tiny_model()
    workdir = Path(tempfile.mkdtemp(prefix="syshax-vllm-"))
    shm = workdir / "shm"
    shm.mkdir()
    extra = {"lease_seconds": LEASE_SECONDS, "reap_interval_seconds": 0.5}
    gpu = VllmEngine(
        "gpu",
        free_port(),
        workdir,
        cpus="0",
        kv_transfer_config=connector_config("gpu", "cpu", shm, **extra),
    )
    cpu = VllmEngine(
        "cpu",
        free_port(),
        workdir,
        cpus="1",
        kv_transfer_config=connector_config("cpu", "gpu", shm, **extra),
    )
    try:
        gpu.wait_ready()
        cpu.wait_ready()
        yield Pair(gpu, cpu, shm, workdir)
    finally:
        gpu.stop()
        cpu.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="package")
def router(engines: Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    workdir = tmp_path_factory.mktemp("router")
    policy = workdir / "policy.json"
    policy.write_text(json.dumps(FORCED_PD))
    proc = Proc(
        "router",
        [
            "router",
            "--gpu-url",
            engines.gpu.url,
            "--cpu-url",
            engines.cpu.url,
            "--model",
            "tiny",
            "--pd-protocol",
            "vllm",
            "--policy",
            str(policy),
            "--log-level",
            "INFO",
        ],
        workdir,
    )
    proc.policy = policy  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        proc.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The first test of the package waits for two engines to start (about a minute each on
    # two busy cores), which the suite's 300 s per-test limit does not allow for.
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(900))
