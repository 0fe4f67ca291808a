"""A producer and a consumer engine for the connector's tests (needs torch)."""

from __future__ import annotations

from pathlib import Path

from kvbench.harness import CPU, TINY, Engine


def make_pair(
    shm_dir: Path, *, backend: str = CPU, arena_mib: float = 1, lease: float = 30.0
) -> tuple[Engine, Engine]:
    """The tiny model's geometry on the CPU: a producer with a 1 MiB arena of 64 KiB slabs
    (a 16-token transfer takes one), and a consumer without an arena."""
    producer = Engine(
        "gpu", "cpu", TINY, device="cpu", backend=backend, num_blocks=64, shm_dir=shm_dir,
        arena_mib=arena_mib, slab_kib=64, lease_seconds=lease, isa="test",
    )  # fmt: skip
    consumer = Engine(
        "cpu", "gpu", TINY, device="cpu", backend=backend, num_blocks=64, shm_dir=shm_dir,
        arena_mib=0, lease_seconds=lease, isa="test",
    )  # fmt: skip
    producer.fill(seed=1)
    consumer.fill(seed=2)
    return producer, consumer


def close(engines: tuple[Engine, Engine], *, crash: bool = False) -> None:
    """Shut both engines down; with ``crash``, as a killed engine ends: its reaper stops,
    nothing else is cleaned up (its arena file stays, the lock goes with the process)."""
    for engine in engines:
        engine.scheduler.shutdown()
        if crash:
            arena = engine.worker._copier._arena
            if arena is not None:
                arena.close(unlink=False)  # the descriptor and its lock go, as at exit
        else:
            engine.worker.shutdown()
