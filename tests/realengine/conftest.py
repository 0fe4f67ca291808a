"""The real-engine tier: a pair of engines on this machine, one in the GPU role and one in the
CPU role, with the SyshaxShmConnector in both and one shared shm directory (the shared IPC
namespace of a real deployment), started once for the whole package per engine kind:

- ``vllm``: two real vLLM 0.32 engines on this machine's CPU (testbed/vllm_env.py);
- ``sim``: two ``syshax sim`` processes speaking the same wire contract (sim_env.py).

The ``engines`` fixture is parametrized over both, so every test that uses it (or ``router``)
runs once per kind, with the same assertions: the simulator is held to the behaviour real vLLM
shows. None of these tests needs a per-kind expectation: the simulator's documented
differences (docs/simulator.md, "Differences from vLLM 0.32": a prefix cache that reuses
blocks without a hash first, its own tokenizer without a BOS token) do not show in what they
check, and it logs an unusable transfer in the connector's words. Should one ever need to, it
belongs on ``Pair``, keyed by ``Pair.kind``, not in a skip.

vLLM is installed into its own virtualenv on first use. A machine where that fails fails the
``vllm`` tests: they are never skipped.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.supervisor import WaitTimeout, free_port
from testbed.vllm_env import (
    EngineProcess,
    VllmEngine,
    connector_config,
    ensure_tiny_model,
    ensure_vllm,
)
from tests.realengine.sim_env import SimEngine
from tests.router.router_procs import Proc, wait_for

# Each connector reaps expired segments; a short lease keeps the lease tests short.
LEASE_SECONDS = 4
# The router's policy file: PD for every request, a re-decision every 16 tokens.
FORCED_PD = {"mode": "forced-pd", "token_limit_min": 16, "token_limit_max": 16}
CONNECTOR_EXTRA = {"lease_seconds": LEASE_SECONDS, "reap_interval_seconds": 0.5}
# The producer's arena: room for the tier's transfers at once (the tiny model's KV pages on
# vLLM's CPU backend are 64 KiB a layer, 128 tokens), small enough for the arena-full test to
# fill it. The decode engine publishes nothing and has none.
GPU_ARENA = {"arena_mib": 4, "slab_kib": 64}
CPU_ARENA = {"arena_mib": 0}
# The simulator's model (a 7B preset, 56 KiB a token) moves more per token: a larger arena,
# whose files are sparse.
SIM_GPU_ARENA = {"arena_mib": 64, "slab_kib": 1024}


@dataclass
class Pair:
    kind: str  # "vllm" or "sim"
    gpu: EngineProcess
    cpu: EngineProcess
    shm: Path
    workdir: Path


def _vllm_pair(workdir: Path, shm: Path) -> tuple[EngineProcess, EngineProcess]:
    ensure_vllm()
    ensure_tiny_model()
    gpu = VllmEngine(
        "gpu",
        free_port(),
        workdir,
        cpus="0",
        kv_transfer_config=connector_config("gpu", "cpu", shm, **CONNECTOR_EXTRA, **GPU_ARENA),
    )
    cpu = VllmEngine(
        "cpu",
        free_port(),
        workdir,
        cpus="1",
        kv_transfer_config=connector_config("cpu", "gpu", shm, **CONNECTOR_EXTRA, **CPU_ARENA),
    )
    return gpu, cpu


def _sim_pair(workdir: Path, shm: Path) -> tuple[EngineProcess, EngineProcess]:
    gpu = SimEngine(
        "gpu",
        free_port(),
        workdir,
        device="a100-80gb",
        kv_transfer_config=connector_config("gpu", "cpu", shm, **CONNECTOR_EXTRA, **SIM_GPU_ARENA),
    )
    cpu = SimEngine(
        "cpu",
        free_port(),
        workdir,
        device="kunpeng-920-7280z",
        kv_transfer_config=connector_config("cpu", "gpu", shm, **CONNECTOR_EXTRA, **CPU_ARENA),
    )
    return gpu, cpu


START_PAIR: dict[str, Callable[[Path, Path], tuple[EngineProcess, EngineProcess]]] = {
    "vllm": _vllm_pair,
    "sim": _sim_pair,
}


@pytest.fixture(
    scope="package",
    params=[pytest.param("vllm", id="vllm"), pytest.param("sim", id="sim")],
)
def engines(request: pytest.FixtureRequest) -> Iterator[Pair]:
    kind: str = request.param
    workdir = Path(tempfile.mkdtemp(prefix=f"syshax-{kind}-"))
    shm = workdir / "shm"
    shm.mkdir()
    started: list[EngineProcess] = []
    try:
        gpu, cpu = START_PAIR[kind](workdir, shm)
        started += [gpu, cpu]
        gpu.wait_ready()
        cpu.wait_ready()
        yield Pair(kind, gpu, cpu, shm, workdir)
    finally:
        for engine in started:
            engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="package")
def router(engines: Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    workdir = tmp_path_factory.mktemp(f"router-{engines.kind}")
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
            # The tests force modes (a gpu-only reference answer) without client keys.
            "--mode-header",
            "all",
        ],
        workdir,
    )
    proc.policy = policy  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        proc.stop()


def segments(shm: Path) -> list[str]:
    """The transfer files in a pair's shm directory (its arena files aside)."""
    return sorted(p.name for p in shm.iterdir() if p.name.startswith("syshax-kv-"))


def router_view(router: Proc, client: httpx.Client | None = None) -> dict[str, dict[str, Any]]:
    """The router's ``/health`` view of each engine, by role (``gpu``, ``cpu``); on
    ``client``'s open connections when given."""
    health = client.get(router.url + "/health") if client else router.get("/health")
    return {b["role"]: b for b in health.json()["backends"]}


def _routable(backend: dict[str, Any]) -> bool:
    scrape = backend["scrape"]
    return (
        backend["up"]
        and not backend["ejected"]
        and not scrape["stale"]
        and scrape["running"] == 0
        and backend["inflight"] == 0
    )


def wait_engines_idle(router: Proc, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Wait until the router sees both engines up, not ejected, freshly scraped and idle;
    returns that view. A decision test starts from there: earlier tests in the tier provoke
    engine errors on purpose (an ejection lasts seconds), and on two loaded cores a scrape
    can time out or still count a sequence that just ended."""
    view: dict[str, dict[str, Any]] = {}

    def idle() -> bool:
        view.update(router_view(router))
        return all(_routable(b) for b in view.values())

    try:
        wait_for(idle, timeout=timeout, interval=0.2)
    except WaitTimeout as exc:
        raise AssertionError(f"the router never saw both engines idle: {view}") from exc
    return view


def router_story(router: Proc, since: int) -> str:
    """What the router logged from offset ``since`` (its warnings say why an engine was
    passed over) and how it sees the engines now: the message of a failed decision test."""
    log = router.log_path.read_text(errors="replace")[since:]
    return f"router log since the test began:\n{log[-3000:]}\nengines now: {router_view(router)}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The first test of each kind waits for two engines to start (about a minute each on
    # two busy cores for vLLM), which the suite's 300 s per-test limit does not allow for.
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(900))
