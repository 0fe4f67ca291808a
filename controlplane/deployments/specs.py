"""Build the engine spec an agent receives (docs/agent.md defines its shape). Pure functions."""

from __future__ import annotations

from typing import Any

from controlplane.deployments.choices import EngineKind
from controlplane.deployments.models import Deployment, DeploymentProfile

GIB = 1024**3


def container_name(deployment: Deployment, role: str, generation: int | None = None) -> str:
    gen = deployment.generation if generation is None else generation
    return f"syshax-{deployment.name}-g{gen}-{role}"


def engine_args(profile: DeploymentProfile, role: str) -> list[str]:
    """vLLM-style engine flags; the simulator accepts the same ones."""
    served = profile.model_name_for_clients
    args: list[str]
    if profile.engine == EngineKind.SIMULATOR:
        device = profile.sim_gpu_device if role == "gpu" else profile.sim_cpu_device
        args = ["--device", device, "--model", profile.model, "--served-model-name", served]
    else:
        args = ["--model", profile.model, "--served-model-name", served]
    args += ["--max-model-len", str(profile.max_model_len)]
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
        if profile.quantization not in ("none", "q4_0", "q8_0") and profile.engine == "vllm":
            args += ["--quantization", profile.quantization]
        return args + list(profile.gpu_extra_args)
    args += ["--port", str(profile.cpu_port), "--max-num-seqs", str(profile.cpu_max_batch_size)]
    if profile.engine == EngineKind.SIMULATOR:
        args += ["--kv-cache-space", f"{profile.cpu_kv_cache_space_gb:g}"]
    return args + list(profile.cpu_extra_args)


def engine_spec(deployment: Deployment, role: str) -> dict[str, Any]:
    profile = deployment.profile
    plan = deployment.affinity_plan or {}
    spec: dict[str, Any] = {
        "deployment": deployment.name,
        "deployment_id": deployment.pk,
        "generation": deployment.generation,
        "role": role,
        "name": container_name(deployment, role),
        "engine": profile.engine,
        "model": profile.model_name_for_clients,
        "health_timeout_seconds": profile.health_timeout_seconds,
    }
    if role == "gpu":
        spec.update(
            image=profile.gpu_image,
            command=list(profile.gpu_command),
            args=engine_args(profile, "gpu"),
            env=dict(profile.gpu_env),
            port=profile.gpu_port,
            accelerators=[
                acc.uuid
                for acc in deployment.node.accelerators.order_by("index")[
                    : profile.tensor_parallel_size
                ]
            ],
            shm_size_bytes=int(profile.gpu_shm_size_gb * GIB),
            cpuset=plan.get("gpu_cpuset", ""),
        )
    else:
        env = {
            "OMP_NUM_THREADS": str(plan.get("omp_num_threads", "")),
            "CUSTOM_CPU_AFFINITY": plan.get("custom_cpu_affinity", ""),
            "VLLM_CPU_KVCACHE_SPACE": f"{profile.cpu_kv_cache_space_gb:g}",
            "SYSHAX_QUANTIZE": profile.quantization if profile.quantization != "none" else "",
        }
        env = {k: v for k, v in env.items() if v}
        env.update(profile.cpu_env)
        spec.update(
            image=profile.cpu_image,
            command=list(profile.cpu_command),
            args=engine_args(profile, "cpu"),
            env=env,
            port=profile.cpu_port,
            cpuset=plan.get("cpuset", ""),
            memory_limit_bytes=(
                int(profile.cpu_memory_limit_gb * GIB) if profile.cpu_memory_limit_gb else None
            ),
            ipc_peer=container_name(deployment, "gpu"),
        )
    return spec
