"""The engine pods of the built-in profiles, validated strictly against Kubernetes 1.34-1.37.

The pods come from ``syshax profile render NAME --kubernetes``, which prints what the agent's
Kubernetes runtime creates (one builder, agents/runtimes/kubernetes_pod.py): the two profiles
``syshax up`` makes (the default hetero profile on simulated engines, and the one on real
vLLM), each on a node with simulated cards (as ``syshax up`` has), NVIDIA GPUs and Ascend NPUs,
as a GPU-and-CPU pair and GPU-only. The runtime's behaviour against a stand-in API is in
tests/agents/test_agent_kubernetes_runtime.py.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from controlplane.deployments.models import DeploymentProfile
from controlplane.inventory.models import Node
from syshax.cli import main as syshax_main
from syshax.commands.up_stack import (
    LOCAL_PROFILE,
    LOCAL_VLLM_PROFILE,
    ensure_deployment,
    ensure_vllm_deployment,
)
from testbed.factories import build_node

KUBERNETES_VERSIONS = ("1.34", "1.35", "1.36", "1.37")
BUILT_IN = (LOCAL_PROFILE, LOCAL_VLLM_PROFILE)
CARDS = ("simulated", "nvidia", "ascend")
NODE = "gpu-node-1"
RESOURCE = {"nvidia": "nvidia.com/gpu", "ascend": "huawei.com/Ascend910"}


def built_in_profiles(cards: str) -> Node:
    """The node (two NUMA nodes of 16 cores, two cards of ``cards``) and ``syshax up``'s
    profiles on it."""
    node = build_node(NODE, accelerators=2, numa=2, cores_per_numa=16)
    if cards != "simulated":
        kind = "npu" if cards == "ascend" else "gpu"
        for card in node.accelerators.all():
            card.simulated, card.kind = False, kind
            card.uuid = f"{'NPU' if kind == 'npu' else 'GPU'}-{card.index}"
            card.save()
    ensure_deployment(NODE, 7001, 7002)
    ensure_vllm_deployment(
        NODE, 7101, 7102, model="/models/qwen2.5-7b", served="qwen", python="/usr/bin/python3"
    )
    DeploymentProfile.objects.filter(name__in=BUILT_IN).update(
        gpu_image="vllm/vllm-openai:v0.32.0", cpu_image="vllm/vllm-cpu:v0.32.0"
    )
    return node


def rendered_pod(name: str, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    code = syshax_main(["profile", "render", name, "--kubernetes", "--node", NODE, *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    pod: dict[str, Any] = yaml.safe_load(out)
    return pod


@pytest.mark.django_db
@pytest.mark.parametrize("cards", CARDS)
def test_the_built_in_profiles_pods_validate_strictly_against_kubernetes_1_34_to_1_37(
    cards: str, capsys: pytest.CaptureFixture[str]
) -> None:
    built_in_profiles(cards)
    validated = 0
    pods = []
    for name in BUILT_IN:
        for pair in (True, False):
            DeploymentProfile.objects.filter(name=name).update(enable_cpu_engine=pair)
            pods.append((name, pair, rendered_pod(name, capsys)))
    for name, pair, pod in pods:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(pod, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(p) for p in error.path)
                pytest.fail(f"{name} ({cards}, pair={pair}) on {version}: {path}: {error.message}")
            validated += 1
        spec = pod["spec"]
        engines = [c for c in spec.get("initContainers", []) if c.get("restartPolicy")]
        engines += spec["containers"]
        assert [c["name"] for c in engines] == (["gpu", "cpu"] if pair else ["gpu"])
        for container in spec.get("initContainers", []) + spec["containers"]:
            resources = container["resources"]
            assert resources["requests"] == resources["limits"], (name, container["name"])
        limits = engines[0]["resources"]["limits"]
        if cards in RESOURCE:
            assert limits[RESOURCE[cards]] == "1"
        else:
            assert set(limits) == {"cpu", "memory"}  # a simulated card is no device
        assert "app.kubernetes.io/managed-by" not in pod["metadata"]["labels"]  # not adopted
    with capsys.disabled():
        print(
            f"\n  engine pods, {cards} cards: {len(pods)} pods of {len(BUILT_IN)} built-in "
            f"profiles, {validated} strict validations ({len(KUBERNETES_VERSIONS)} versions)"
        )
    assert validated == len(pods) * len(KUBERNETES_VERSIONS)


@pytest.mark.django_db
def test_the_default_hetero_pod_is_the_pair_with_the_plans_cpus_and_a_model_claim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    built_in_profiles("nvidia")
    pod = rendered_pod(LOCAL_VLLM_PROFILE, capsys, "--model-claim", "models")
    spec = pod["spec"]
    gpu = spec["initContainers"][-1]
    (cpu,) = spec["containers"]
    assert gpu["restartPolicy"] == "Always" and gpu["startupProbe"]["httpGet"]["port"] == 7101
    assert int(cpu["resources"]["limits"]["cpu"]) >= 1
    (model,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert model["persistentVolumeClaim"] == {"claimName": "models"}
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]["matchFields"][0]["values"] == [NODE]


@pytest.mark.django_db
def test_render_refuses_docker_and_kubernetes_together(capsys: pytest.CaptureFixture[str]) -> None:
    built_in_profiles("simulated")
    code = syshax_main(["profile", "render", LOCAL_PROFILE, "--docker", "--kubernetes"])
    assert code == 2
    assert "choose one of --docker and --kubernetes" in capsys.readouterr().err
