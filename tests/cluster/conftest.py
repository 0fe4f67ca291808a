"""Fixtures of the cluster tests: a private network of namespaces and a fleet on it.

They need root and iproute2. On CI (CI=true) a machine without them fails the tests; elsewhere
only a non-root run skips them, with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.fleet import Fleet
from tests.support.netns import Network, isolated_network, netns_problem

CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_netns() -> None:
    problem = netns_problem()
    if problem is None:
        return
    if CI:
        pytest.fail(f"{problem}; CI=true runs the cluster tests", pytrace=False)
    if os.geteuid() != 0:
        pytest.skip(problem)
    pytest.fail(problem, pytrace=False)


@pytest.fixture
def network() -> Iterator[Network]:
    require_netns()
    with isolated_network() as net:
        yield net


@pytest.fixture
def fleet(network: Network, tmp_path: Path, settings: Any) -> Iterator[Fleet]:
    f = Fleet(network, tmp_path)
    # The reaper runs in this process (Fleet.reap): give it the fleet's grace period.
    settings.HEARTBEAT_INTERVAL_SECONDS = f.interval
    settings.HEARTBEAT_TOLERANCE = f.tolerance
    try:
        yield f
    finally:
        f.close()
