"""Simulated engines for the load generator's tests: real processes on ephemeral ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadgen.simproc import running_sim


@pytest.fixture(scope="session")
def fast_sim() -> Iterator[str]:
    """An A100 engine at 20x speed: functional tests that do not compare timings."""
    with running_sim("a100-80gb", speed=20.0) as url:
        yield url


@pytest.fixture(scope="session")
def realtime_sim() -> Iterator[str]:
    """An A100 engine in real time, for comparing the generator's clock with the engine's."""
    with running_sim("a100-80gb", speed=1.0) as url:
        yield url
