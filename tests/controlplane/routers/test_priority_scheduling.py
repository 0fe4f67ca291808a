"""The routing payload's ``priority_scheduling``: true only where every engine of the
deployment runs vLLM's ``--scheduling-policy priority`` (docs/slo-classes.md)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.routers.services import routable_deployments


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ({}, False),
        ({"gpu_extra_args": ["--scheduling-policy", "priority"]}, False),  # the CPU does not
        (
            {
                "gpu_extra_args": ["--scheduling-policy", "priority"],
                "cpu_extra_args": ["--scheduling-policy=priority"],
            },
            True,
        ),
        (
            {"gpu_extra_args": ["--scheduling-policy", "priority"], "enable_cpu_engine": False},
            True,
        ),
        ({"gpu_extra_args": ["--scheduling-policy", "fcfs"], "enable_cpu_engine": False}, False),
    ],
)
def test_priority_scheduling_follows_the_engines_arguments(
    make_deployment: Any, node: Any, make_profile: Any, profile: dict[str, Any], expected: bool
) -> None:
    cpu = profile.get("enable_cpu_engine", True)
    make_deployment(
        node=node,
        profile=make_profile(**profile),
        state="running",
        gpu_endpoint="http://127.0.0.1:7001",
        cpu_endpoint="http://127.0.0.1:7002" if cpu else "",
    )
    (entry,) = routable_deployments()
    assert entry["priority_scheduling"] is expected
