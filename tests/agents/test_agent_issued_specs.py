"""What the project itself issues runs under the agent's default policy: the specs the control
plane builds (controlplane/deployments/specs.py, which ``syshax profile render`` prints too)
for ``syshax up``'s simulators, ``syshax up --engine vllm``, the test rigs' simulators, and
the vLLM and simulator images of the docker runtime."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from agents.engine_policy import EnginePolicy
from common.engine_spec import EngineSpec, SpecError
from controlplane.deployments import services
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.deployments.specs import engine_spec
from syshax.commands import up_stack
from testbed.factories import build_node, build_profile

pytestmark = pytest.mark.django_db

BIN = os.path.dirname(os.path.abspath(sys.executable))
VLLM_PYTHON = "/opt/vllm/bin/python"  # an --engine-python: a vLLM venv beside the agent's
SIM = [sys.executable, "-m", "syshax.cli", "sim"]  # how the e2e and cluster tests run it
PROCESS = EnginePolicy(search_path=BIN)  # the agent's default policy; `syshax` is on its PATH
WITH_VLLM = EnginePolicy(interpreters=(*PROCESS.interpreters, VLLM_PYTHON), search_path=BIN)
DOCKER = EnginePolicy()


def issued(deployment: Deployment) -> list[EngineSpec]:
    """The specs of the deployment's engines, as its agent receives them."""
    roles = ["gpu", "cpu"] if deployment.profile.enable_cpu_engine else ["gpu"]
    return [EngineSpec.from_dict(engine_spec(deployment, role)) for role in roles]


def placed(profile: DeploymentProfile) -> Deployment:
    """``profile`` on a node of its own, with the CPU plan the control plane makes there."""
    return services.create_deployment(
        name=f"d-{profile.pk}", profile=profile, node=build_node(), acting_user="test"
    )


def test_syshax_ups_simulator_pair_passes_the_default_policy() -> None:
    node = build_node()
    deployment = Deployment.objects.get(pk=up_stack.ensure_deployment(node.name, 7001, 7002))
    specs = issued(deployment)
    assert [s.command for s in specs] == [("syshax", "sim")] * 2
    for spec in specs:
        assert PROCESS.check(spec, "process").command[0] == f"{BIN}/syshax"


def test_syshax_up_engine_vllm_passes_once_the_agent_is_told_of_its_python(
    tmp_path: Path,
) -> None:
    node = build_node()
    pk = up_stack.ensure_vllm_deployment(
        node.name, 7001, 7002, model=str(tmp_path), served="tiny", python=VLLM_PYTHON
    )
    specs = issued(Deployment.objects.get(pk=pk))
    assert specs[0].kv_connector and "--kv-transfer-config" in specs[0].args
    for spec in specs:
        WITH_VLLM.check(spec, "process")
        # syshax up passes --engine-python; without it this interpreter is not the agent's.
        with pytest.raises(SpecError, match="widen with --engine-python"):
            PROCESS.check(spec, "process")


@pytest.mark.parametrize(
    ("fields", "policy"),
    [
        ({"gpu_command": SIM, "cpu_command": SIM, "pd_protocol": "vllm"}, PROCESS),
        ({"gpu_command": SIM, "cpu_command": SIM, "pd_protocol": "syshax"}, PROCESS),
        (
            {
                "engine": "vllm",
                "quantization": "awq",
                "pd_protocol": "vllm",
                "gpu_command": [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"],
                "cpu_command": [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"],
            },
            WITH_VLLM,
        ),
        (
            {
                "engine": "vllm",
                "quantization": "none",
                "gpu_command": [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"],
                "cpu_command": [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"],
                "otlp_traces_endpoint": "http://collector:4318",
                "trace_detail": "all",
            },
            WITH_VLLM,
        ),
        (
            {"gpu_command": SIM, "cpu_command": SIM, "otlp_traces_endpoint": "http://c:4318"},
            PROCESS,
        ),
    ],
    ids=["simulator-vllm-pd", "simulator-syshax-pd", "vllm-process", "vllm-traced", "sim-traced"],
)
def test_placed_process_engines_pass_the_default_policy(
    fields: dict[str, Any], policy: EnginePolicy
) -> None:
    specs = issued(placed(build_profile(**fields)))
    assert specs[1].cpuset  # placed: the CPU engine's plan and thread settings are in
    for spec in specs:
        policy.check(spec, "process")


@pytest.mark.parametrize(
    "fields",
    [
        {"engine": "vllm", "quantization": "none", "pd_protocol": "vllm"},  # the images' default
        {"engine": "syshax-v0", "quantization": "none", "pd_protocol": "syshax"},
        # docker compose's simulators: the project image, `syshax sim`
        {"gpu_image": "syshax-controlplane:latest", "cpu_image": "syshax-controlplane:latest"},
    ],
    ids=["vllm-images", "syshax-v0", "simulator-project-image"],
)
def test_placed_container_engines_pass_the_default_policy(fields: dict[str, Any]) -> None:
    for spec in issued(placed(build_profile(**fields))):
        DOCKER.check(spec, "docker")
