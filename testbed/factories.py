"""Plain builders of one object each, shared by the test areas' fixtures (which choose the
defaults their tests read best with)."""

from __future__ import annotations

import itertools
from typing import Any

from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.inventory.models import Accelerator, CpuTopology, Node, NumaNode
from controlplane.policy.services import ensure_default_policy

GIB = 1024**3
_seq = itertools.count(1)


def build_node(
    name: str | None = None,
    *,
    prefix: str = "node",
    accelerators: int = 1,
    accel_gb: int = 80,
    sockets: int = 1,
    numa: int = 2,
    cores_per_numa: int = 4,
    cpu_model: str = "Test CPU",
    architecture: str = "x86_64",
    isa_flags: tuple[str, ...] = ("avx2",),
    accel_used_fraction: float = 0.0,
    accel_utilization: float = 0.0,
    **fields: Any,
) -> Node:
    node = Node.objects.create(name=name or f"{prefix}-{next(_seq)}", address="127.0.0.1", **fields)
    CpuTopology.objects.create(
        node=node,
        model_name=cpu_model,
        architecture=architecture,
        sockets=sockets,
        physical_cores=numa * cores_per_numa,
        threads=numa * cores_per_numa,
        isa_flags=list(isa_flags),
        memory_total_bytes=numa * 32 * GIB,
    )
    for index in range(numa):
        first = index * cores_per_numa
        NumaNode.objects.create(
            node=node,
            index=index,
            cpus=f"{first}-{first + cores_per_numa - 1}",
            memory_total_bytes=32 * GIB,
        )
    for index in range(accelerators):
        Accelerator.objects.create(
            node=node,
            kind="gpu",
            vendor="NVIDIA",
            model_name="A100-SXM4-80GB",
            index=index,
            uuid=f"GPU-{node.name}-{index}",
            memory_total_bytes=accel_gb * GIB,
            memory_used_bytes=int(accel_gb * GIB * accel_used_fraction),
            utilization_percent=accel_utilization,
            simulated=True,
        )
    return node


def build_profile(*, prefix: str = "profile", **fields: Any) -> DeploymentProfile:
    defaults: dict[str, Any] = {
        "name": f"{prefix}-{next(_seq)}",
        "model": "deepseek-r1-distill-qwen-32b",
        "engine": "simulator",
        "quantization": "q4_0",
    }
    return DeploymentProfile.objects.create(**{**defaults, **fields})


def build_deployment(
    node: Node, profile: DeploymentProfile, *, prefix: str = "dep", **fields: Any
) -> Deployment:
    return Deployment.objects.create(
        name=fields.pop("name", f"{prefix}-{next(_seq)}"),
        node=node,
        profile=profile,
        policy=ensure_default_policy(),
        **fields,
    )
