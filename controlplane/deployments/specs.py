"""Build the engine spec an agent receives, with the agents' own builders (agents.specs), so
both sides agree on its shape (docs/agent.md)."""

from __future__ import annotations

from typing import Any

from agents.specs import Accelerator, EngineSpec, engine_name
from controlplane.deployments.choices import EngineKind
from controlplane.deployments.models import Deployment, DeploymentProfile

GIB = 1024**3
SIMULATOR_COMMAND = ["syshax", "sim"]


def engine_args(profile: DeploymentProfile, role: str) -> list[str]:
    """vLLM-style engine flags; the simulator accepts the same ones plus its device preset."""
    served = profile.model_name_for_clients
    args: list[str] = []
    if profile.engine == EngineKind.SIMULATOR:
        device = profile.sim_gpu_device if role == "gpu" else profile.sim_cpu_device
        args += ["--device", device]
    args += [
        "--model",
        profile.model,
        "--served-model-name",
        served,
        "--max-model-len",
        str(profile.max_model_len),
    ]
    if role == "gpu":
        args += [
            "--port",
            str(profile.gpu_port),
            "--tensor-parallel-size",
            str(profile.tensor_parallel_size),
            "--gpu-memory-utilization",
            str(profile.gpu_memory_utilization),
            "--max-num-seqs",
            str(profile.max_num_seqs),
            "--preemption-mode",
            profile.preemption_mode,
        ]
        if profile.engine == EngineKind.VLLM and profile.quantization in ("awq", "gptq", "fp8"):
            args += ["--quantization", profile.quantization]
        return args + list(profile.gpu_extra_args)
    args += ["--port", str(profile.cpu_port), "--max-num-seqs", str(profile.cpu_max_batch_size)]
    if profile.engine == EngineKind.SIMULATOR:
        args += ["--kv-cache-space", f"{profile.cpu_kv_cache_space_gb:g}"]
    return args + list(profile.cpu_extra_args)


def _command(profile: DeploymentProfile, role: str) -> list[str]:
    configured = list(profile.gpu_command if role == "gpu" else profile.cpu_command)
    if configured:
        return configured
    return list(SIMULATOR_COMMAND) if profile.engine == EngineKind.SIMULATOR else []


def engine_spec(deployment: Deployment, role: str) -> dict[str, Any]:
    profile = deployment.profile
    plan = deployment.affinity_plan or {}
    host = deployment.node.address or "127.0.0.1"
    name = engine_name(deployment.pk, deployment.generation, role)
    if role == "gpu":
        accelerators = tuple(
            Accelerator(uuid=acc.uuid, index=acc.index, simulated=acc.simulated, kind=acc.kind)
            for acc in deployment.node.accelerators.order_by("index")[
                : profile.tensor_parallel_size
            ]
        )
        spec = EngineSpec(
            command=tuple(_command(profile, "gpu")),
            args=tuple(engine_args(profile, "gpu")),
            image=profile.gpu_image,
            env=dict(profile.gpu_env),
            port=profile.gpu_port,
            host=host,
            cpuset=plan.get("gpu_cpuset") or None,
            shm_size_bytes=int(profile.gpu_shm_size_gb * GIB),
            accelerators=accelerators,
            ipc="shareable",
            health_timeout_seconds=profile.health_timeout_seconds,
            name=name,
        )
    else:
        env = {
            "OMP_NUM_THREADS": str(plan.get("omp_num_threads", "")),
            "CUSTOM_CPU_AFFINITY": str(plan.get("custom_cpu_affinity", "")),
            "VLLM_CPU_KVCACHE_SPACE": f"{profile.cpu_kv_cache_space_gb:g}",
            "SYSHAX_QUANTIZE": profile.quantization if profile.quantization != "none" else "",
        }
        env = {k: v for k, v in env.items() if v}
        env.update(profile.cpu_env)
        spec = EngineSpec(
            command=tuple(_command(profile, "cpu")),
            args=tuple(engine_args(profile, "cpu")),
            image=profile.cpu_image,
            env=env,
            port=profile.cpu_port,
            host=host,
            cpuset=plan.get("cpuset") or None,
            memory_limit_bytes=(
                int(profile.cpu_memory_limit_gb * GIB) if profile.cpu_memory_limit_gb else None
            ),
            ipc="peer",
            health_timeout_seconds=profile.health_timeout_seconds,
            name=name,
            ipc_peer=engine_name(deployment.pk, deployment.generation, "gpu"),
        )
    return {
        **spec.to_dict(),
        "deployment": deployment.name,
        "deployment_id": deployment.pk,
        "generation": deployment.generation,
        "role": role,
        "engine": profile.engine,
        "model": profile.model_name_for_clients,
    }
