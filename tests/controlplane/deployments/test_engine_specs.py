"""What each engine kind gets on its command line and in its environment, the profile rules
that keep the combinations valid, and the CPU engine's limit in the routing payload."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
from django.contrib import admin
from django.forms.models import model_to_dict
from django.test import RequestFactory

from common.engine_spec import EngineSpec
from common.policy_schema import PolicyKnobs
from common.presets import DEVICES, DevicePreset, device_preset
from common.routing import DeploymentSpec
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.deployments.services import placement_plan
from controlplane.deployments.specs import engine_spec
from controlplane.routers.services import routable_deployments
from router.decide import Loads, Route, decide
from router.engines.backends import Backend, Timeouts
from router.engines.load import DeviceLoad
from router.state import Deployment as RoutedDeployment
from sim.cli import add_arguments as sim_arguments
from sim.perfmodel import bind_cpu

PLAN = {
    "cpuset": "2-7",
    "physical_cores": 6,
    "omp_num_threads": 6,
    "custom_cpu_affinity": "2-3,4-7",
    "gpu_cpuset": "0-1",
}


def specs(make_deployment, node, make_profile, **profile: Any) -> tuple[dict, dict, Deployment]:
    deployment = make_deployment(
        node=node, profile=make_profile(**profile), affinity_plan=PLAN, generation=3
    )
    return engine_spec(deployment, "gpu"), engine_spec(deployment, "cpu"), deployment


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_upstream_vllm_gets_v1_flags_the_kv_connector_and_its_thread_binding(
    make_deployment, node, make_profile
) -> None:
    gpu, cpu, deployment = specs(
        make_deployment, node, make_profile, engine="vllm", quantization="none"
    )
    gpu_name, cpu_name = f"syshax-{deployment.pk}-g3-gpu", f"syshax-{deployment.pk}-g3-cpu"
    # The prefill engine publishes into its arena (the profile's kv_arena_mib); the decode
    # engine only loads and has none.
    for spec, me, peer, arena in ((gpu, gpu_name, cpu_name, 2048), (cpu, cpu_name, gpu_name, 0)):
        assert "--preemption-mode" not in spec["args"] and "--syshax-compat" not in spec["args"]
        assert json.loads(flag(spec["args"], "--kv-transfer-config") or "") == {
            "kv_connector": "SyshaxShmConnector",
            "kv_connector_module_path": "syshax_kv_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "shm_dir": "/dev/shm",
                "lease_seconds": 30,
                "arena_mib": arena,
                "engine_id": me,
                "peer_engine_id": peer,
            },
        }
        assert spec["kv_connector"] is True
        assert EngineSpec.from_dict(spec).kv_connector is True  # the agent reads it back
    assert flag(cpu["args"], "--max-num-seqs") == "8"  # the profile's cpu_max_num_seqs
    env = cpu["env"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3,4-7" and env["OMP_NUM_THREADS"] == "6"
    assert "CUSTOM_CPU_AFFINITY" not in env
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) == 40  # what vLLM does with it


def test_syshax_v0_keeps_its_preemption_mode_and_custom_cpu_affinity(
    make_deployment, node, make_profile
) -> None:
    gpu, cpu, _ = specs(
        make_deployment,
        node,
        make_profile,
        engine="syshax-v0",
        pd_protocol="syshax",
        preemption_mode="swap",
        quantization="awq",
    )
    assert flag(gpu["args"], "--preemption-mode") == "swap"
    assert flag(gpu["args"], "--quantization") == "awq"
    assert "--kv-transfer-config" not in gpu["args"] + cpu["args"]
    assert gpu["kv_connector"] is False and cpu["kv_connector"] is False
    assert cpu["env"]["CUSTOM_CPU_AFFINITY"] == "2-3,4-7"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu["env"]


def sim_parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sim_arguments(parser)
    return parser.parse_args(args)


@pytest.mark.parametrize("protocol", ["vllm", "syshax"])
def test_the_simulator_gets_flags_it_accepts_in_the_mode_of_the_protocol(
    make_deployment, node, make_profile, protocol: str
) -> None:
    gpu, cpu, _ = specs(
        make_deployment, node, make_profile, pd_protocol=protocol, cpu_kv_cache_space_gb=12
    )
    compat = protocol == "syshax"
    gpu_args, cpu_args = sim_parse(gpu["args"]), sim_parse(cpu["args"])
    assert gpu_args.syshax_compat is compat and cpu_args.syshax_compat is compat
    assert gpu_args.preemption_mode == ("swap" if compat else None)
    assert ("--kv-transfer-config" in gpu["args"]) is not compat
    assert cpu_args.kv_cache_space == 12 and cpu["env"]["VLLM_CPU_KVCACHE_SPACE"] == "12"
    # This 8-core node is not the simulated Kunpeng: the host's binding is not its cores.
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu["env"] and cpu["cpuset"] == "2-7"


def simulated_cpu_device(spec: dict[str, Any]) -> DevicePreset:
    """The CPU device ``syshax sim`` models when started as ``spec`` says."""
    args = sim_parse(spec["args"])
    binding = args.cpu_bind or spec["env"].get("VLLM_CPU_OMP_THREADS_BIND", "")
    return bind_cpu(device_preset(args.device), binding)


def test_a_simulated_cpu_engine_on_a_small_host_models_its_whole_preset(
    make_deployment, make_node, make_profile
) -> None:
    # syshax up's node: this machine's CPUs (here 2 cores on one NUMA node) beside a simulated
    # A100. The host's plan binds the CPU engine to 0-1; read as the Kunpeng preset's core ids
    # that was 2 of its 160 cores, a prefill 80x slower, and the benchmark's CPU row timed out.
    laptop = make_node("laptop", numa=1, cores_per_numa=2)
    profile = make_profile(sim_cpu_device="kunpeng-920-7280z", pd_protocol="vllm")
    plan = placement_plan(profile, laptop)
    deployment = make_deployment(node=laptop, profile=profile, affinity_plan=plan)
    cpu = engine_spec(deployment, "cpu")
    assert cpu["cpuset"] == "0-1"  # the process still runs on the host's planned cores
    device = simulated_cpu_device(cpu)
    assert (device.cores, device.numa_nodes) == (160, 4)
    assert device == DEVICES["kunpeng-920-7280z"]
    # Real vLLM on the same host computes on those cores: it is bound to them.
    vllm = make_profile(engine="vllm", quantization="none")
    plan = placement_plan(vllm, laptop)
    real = engine_spec(make_deployment(node=laptop, profile=vllm, affinity_plan=plan), "cpu")
    assert real["env"]["VLLM_CPU_OMP_THREADS_BIND"] == plan["custom_cpu_affinity"] == "0-1"


def test_a_simulated_cpu_engine_on_a_host_of_its_preset_shape_keeps_the_binding(
    make_deployment, make_node, make_profile
) -> None:
    # A Kunpeng 920 7280Z host (4 NUMA nodes x 40 cores): its CPU ids are the preset's cores.
    kunpeng = make_node("kunpeng", numa=4, cores_per_numa=40, architecture="aarch64")
    profile = make_profile(sim_cpu_device="kunpeng-920-7280z")
    plan = placement_plan(profile, kunpeng)
    cpu = engine_spec(make_deployment(node=kunpeng, profile=profile, affinity_plan=plan), "cpu")
    assert cpu["env"]["VLLM_CPU_OMP_THREADS_BIND"] == plan["custom_cpu_affinity"]
    device = simulated_cpu_device(cpu)
    assert device.cores == plan["physical_cores"] < 160  # two cores stay with the GPU engine
    assert device.numa_nodes == 4


def test_without_a_cpu_engine_there_is_no_kv_transfer(make_deployment, node, make_profile) -> None:
    gpu, _, _ = specs(make_deployment, node, make_profile, engine="vllm", enable_cpu_engine=False)
    assert "--kv-transfer-config" not in gpu["args"] and gpu["kv_connector"] is False


def post_profile(client, **fields: Any):
    return client.post("/api/v1/profiles/", {"name": "p", "model": "m", **fields}, format="json")


def test_upstream_vllm_with_the_syshax_protocol_is_a_400_naming_the_field(
    admin_client, make_profile
) -> None:
    response = post_profile(admin_client, engine="vllm", pd_protocol="syshax")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == (
        'pd_protocol: "syshax" needs an engine that speaks sysHAX\'s fields '
        "(syshax-v0 or simulator); upstream vLLM ignores them"
    )
    assert list(error["fields"]) == ["pd_protocol"]
    # A change that makes a stored profile invalid is refused the same way.
    profile = make_profile(engine="vllm")
    patch = admin_client.patch(
        f"/api/v1/profiles/{profile.pk}/", {"pd_protocol": "syshax"}, format="json"
    )
    assert patch.status_code == 400 and patch.json()["error"]["fields"].keys() == {"pd_protocol"}


def test_engine_and_protocol_pairs_that_work_are_accepted(admin_client) -> None:
    assert post_profile(admin_client).json()["pd_protocol"] == "vllm"  # the default
    for name, engine, protocol in [
        ("sim-syshax", "simulator", "syshax"),
        ("sim-vllm", "simulator", "vllm"),
        ("v0", "syshax-v0", "syshax"),
    ]:
        response = post_profile(admin_client, name=name, engine=engine, pd_protocol=protocol)
        assert response.status_code == 201, response.json()
    refused = post_profile(admin_client, name="v0-vllm", engine="syshax-v0", pd_protocol="vllm")
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith('pd_protocol: "vllm" needs an engine')


def test_the_admin_form_reaches_the_same_rule(admin_user, make_profile) -> None:
    profile = make_profile(engine="vllm")
    model_admin = admin.site._registry[DeploymentProfile]
    request = RequestFactory().get("/")
    request.user = admin_user
    form_class = model_admin.get_form(request, obj=profile)
    data = {
        key: json.dumps(value) if isinstance(value, list | dict) else value
        for key, value in model_to_dict(profile).items()
        if value is not None
    }
    assert form_class(data=data, instance=profile).is_valid()
    form = form_class(data={**data, "pd_protocol": "syshax"}, instance=profile)
    assert not form.is_valid()
    assert "upstream vLLM ignores them" in form.errors["pd_protocol"][0]


def test_kv_cache_space_is_whole_gib(admin_client) -> None:
    response = post_profile(admin_client, cpu_kv_cache_space_gb=1.5)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "cpu_kv_cache_space_gb: must be a whole number of GiB (vLLM reads "
        "VLLM_CPU_KVCACHE_SPACE with int())"
    )
    assert post_profile(admin_client, cpu_kv_cache_space_gb=2).json()["cpu_kv_cache_space_gb"] == 2


def test_the_routing_payload_carries_the_cpu_engines_limit_and_the_router_caps_at_it(
    router_client, make_deployment, node, make_profile
) -> None:
    make_deployment(
        node=node,
        profile=make_profile(cpu_max_num_seqs=4),
        state="running",
        gpu_endpoint="http://127.0.0.1:7001",
        cpu_endpoint="http://127.0.0.1:7002",
    )
    (entry,) = router_client.get("/api/v1/routing/deployments").json()["deployments"]
    assert entry["cpu_max_num_seqs"] == 4
    assert routable_deployments() == [entry]
    spec = DeploymentSpec.from_api(entry)
    assert spec.cpu_max_num_seqs == 4
    old = {k: v for k, v in entry.items() if k != "cpu_max_num_seqs"}
    assert DeploymentSpec.from_api(old).cpu_max_num_seqs is None  # an older control plane

    timeouts = Timeouts()
    routed = RoutedDeployment(
        spec, Backend(spec.gpu_url, "gpu", timeouts), Backend(entry["cpu_url"], "cpu", timeouts)
    )
    assert routed.loads(0.0).cpu_max_num_seqs == 4
    # The GPU is full, so new decodes go to the CPU while it has room under min(8, 4).
    knobs = PolicyKnobs(cpu_max_batch_size=8, max_num_seqs=16)
    full_gpu = DeviceLoad(True, 16, 0, 50.0, 0.0, None)

    def route(cpu_running: int, limit: int | None) -> tuple[Route, str]:
        # A measured CPU well inside its latency SLO: only the batch caps bind.
        cpu = DeviceLoad(True, cpu_running, 0, 0.0, 0.0, 20.0, itl_batch=float(cpu_running))
        decision = decide(knobs, Loads(full_gpu, cpu, cpu_max_num_seqs=limit))
        return decision.route, decision.reason

    assert route(3, 4)[0] is Route.PD
    capped, reason = route(4, 4)
    assert capped is Route.GPU_ONLY and "CPU running 4 >= the CPU engine's max_num_seqs 4" in reason
    assert route(4, None)[0] is Route.PD  # unknown engine limit: the policy's 8 alone
    assert route(8, None)[1].count("cpu_max_batch_size 8") == 1


def test_the_routing_payload_carries_node_telemetry_in_steps(
    router_client, make_deployment, node
) -> None:
    from controlplane.deployments.models import AcceleratorClaim
    from controlplane.inventory.models import Accelerator, Heartbeat

    deployment = make_deployment(node=node, state="running", gpu_endpoint="http://127.0.0.1:7001")
    (entry,) = router_client.get("/api/v1/routing/deployments").json()["deployments"]
    assert entry["telemetry"] == {"gpu_temperature_c": None, "host_memory_percent": None}
    for index, temperature in enumerate((71.0, 87.3)):
        card = Accelerator.objects.create(
            node=node, kind="gpu", index=90 + index, uuid=f"T-{index}", temperature_c=temperature
        )
        AcceleratorClaim.objects.create(accelerator=card, deployment=deployment)
    Heartbeat.objects.create(node=node, memory_used_bytes=10, memory_total_bytes=100)
    Heartbeat.objects.create(node=node, memory_used_bytes=96, memory_total_bytes=100)
    (entry,) = router_client.get("/api/v1/routing/deployments").json()["deployments"]
    # The hottest card it holds and the latest heartbeat, each in steps of 5.
    assert entry["telemetry"] == {"gpu_temperature_c": 85.0, "host_memory_percent": 95.0}
    spec = DeploymentSpec.from_api(entry)
    assert (spec.gpu_temperature_c, spec.host_memory_percent) == (85.0, 95.0)
    with pytest.raises(ValueError, match="telemetry 'gpu_temperature_c' must be a number"):
        DeploymentSpec.from_api({**entry, "telemetry": {"gpu_temperature_c": "hot"}})


def test_the_routing_payload_saved_as_a_file_is_a_standalone_routers_deployments_file(
    router_client, make_deployment, node, other_node, make_profile, tmp_path
) -> None:
    """``--deployments-file`` takes what ``routing/deployments`` serves, read by the same
    parser, so an operator can save the control plane's answer and route without it."""
    import yaml

    from common.routing import parse_deployments
    from router.policy.deployments_file import load_deployments_file

    profile = make_profile()
    for host, index in ((node, 2), (other_node, 3)):
        make_deployment(
            node=host,
            profile=profile,
            state="running",
            gpu_endpoint=f"http://10.0.0.{index}:7001",
            cpu_endpoint=f"http://10.0.0.{index}:7002",
        )
    answer = router_client.get("/api/v1/routing/deployments").json()
    assert answer == {"deployments": routable_deployments()}
    served = parse_deployments(answer)
    assert len(served) == 2 and len({spec.model for spec in served}) == 1  # two replicas
    saved_json, saved_yaml = tmp_path / "deployments.json", tmp_path / "deployments.yaml"
    saved_json.write_text(json.dumps(answer))
    saved_yaml.write_text(yaml.safe_dump(answer))
    assert load_deployments_file(str(saved_json)) == served
    assert load_deployments_file(str(saved_yaml)) == served


def test_the_migration_rounds_kv_space_up_and_moves_syshax_protocol_vllm_to_syshax_v0(
    transactional_db,
) -> None:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before = [("deployments", "0001_initial")]
    after = [("deployments", "0002_engine_kinds_and_whole_gib_kv_space")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(before)
    try:
        old = MigrationExecutor(connection).loader.project_state(before).apps
        Profile = old.get_model("deployments", "DeploymentProfile")
        rows = {
            name: Profile.objects.create(
                name=name, model="m", engine=engine, pd_protocol=protocol, **fields
            ).pk
            for name, engine, protocol, fields in [
                ("half", "vllm", "vllm", {"cpu_kv_cache_space_gb": 1.5}),
                ("whole", "simulator", "syshax", {"cpu_kv_cache_space_gb": 40.0}),
                ("v0", "vllm", "syshax", {"cpu_kv_cache_space_gb": 7.01}),
            ]
        }
        MigrationExecutor(connection).migrate(after)
    finally:
        MigrationExecutor(connection).migrate(latest)  # the rest of the suite's schema
    stored = {
        p.name: (p.engine, p.pd_protocol, p.cpu_kv_cache_space_gb)
        for p in DeploymentProfile.objects.filter(pk__in=rows.values())
    }
    assert stored == {
        "half": ("vllm", "vllm", 2),
        "whole": ("simulator", "syshax", 40),
        "v0": ("syshax-v0", "syshax", 8),
    }
