"""Build the engine spec an agent receives, in the shared shape (common.engine_spec) the
agent validates, so both sides agree on it (docs/agent.md).

What goes on the command line depends on the engine kind (docs/operator-guide.md):

* ``vllm``, upstream vLLM V1: no ``--preemption-mode`` (V1 always recomputes and refuses the
  flag), thread binding in ``VLLM_CPU_OMP_THREADS_BIND``, and with PD both engines load the
  syshax KV connector through ``--kv-transfer-config``;
* ``syshax-v0``, sysHAX's patched V0 image: ``--preemption-mode`` and ``CUSTOM_CPU_AFFINITY``,
  KV handed over with sysHAX's request fields;
* ``simulator``: upstream's flags, or with ``pd_protocol: syshax`` its sysHAX-compatible mode
  (``--syshax-compat``, which also takes ``--preemption-mode``). Its thread binding only on a
  node shaped like its CPU preset (see ``binds_device_cores``).
"""

from __future__ import annotations

from typing import Any

from common.affinity import thread_env
from common.engine_spec import Accelerator, EngineSpec, engine_name, kv_transfer_config
from common.presets import DEVICES
from common.tracing import checked_endpoint
from controlplane.deployments.choices import EngineKind, TraceDetail
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.inventory.models import LOOPBACK, Node
from controlplane.inventory.models import Accelerator as AcceleratorRow

GIB = 1024**3
SIMULATOR_COMMAND = ["syshax", "sim"]
VLLM_QUANTIZATION = ("awq", "gptq", "fp8")  # the profile quantizations vLLM takes as flags


def engine_args(
    profile: DeploymentProfile,
    role: str,
    *,
    engine_id: str = "",
    peer_engine_id: str = "",
    host: str = "",
) -> list[str]:
    """The engine's flags for its kind; the KV connector's config names this engine and its
    PD peer (the agents' engine names). ``host`` is the node's address: vLLM listens on every
    interface by default, the simulator only where it is told (its default is 127.0.0.1)."""
    served = profile.model_name_for_clients
    args: list[str] = []
    if profile.engine == EngineKind.SIMULATOR:
        device = profile.sim_gpu_device if role == "gpu" else profile.sim_cpu_device
        args += ["--device", device]
        if host and host != "127.0.0.1":
            args += ["--host", host]
        if profile.speaks_syshax:
            args.append("--syshax-compat")
    args += ["--model", profile.model, "--served-model-name", served]
    args += tracing_args(profile)
    if profile.max_model_len:  # empty: the model's own length, as the engine derives it
        args += ["--max-model-len", str(profile.max_model_len)]
    if profile.uses_kv_connector:
        arena = profile.kv_arena_mib if role == "gpu" else 0  # only the prefill publishes
        args += [
            "--kv-transfer-config",
            kv_transfer_config(engine_id, peer_engine_id, arena_mib=arena),
        ]
        # The decode's usage then reports the cached prompt tokens: the router's proof that
        # the transferred KV was used (docs/kv-connector.md).
        args.append("--enable-prompt-tokens-details")
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
        ]
        if profile.speaks_syshax:
            args += ["--preemption-mode", profile.preemption_mode]
        if profile.engine != EngineKind.SIMULATOR and profile.quantization in VLLM_QUANTIZATION:
            args += ["--quantization", profile.quantization]
        return args + list(profile.gpu_extra_args)
    args += ["--port", str(profile.cpu_port), "--max-num-seqs", str(profile.cpu_max_num_seqs)]
    if profile.engine == EngineKind.SIMULATOR:
        args += ["--kv-cache-space", str(profile.cpu_kv_cache_space_gb)]
    return args + list(profile.cpu_extra_args)


def tracing_args(profile: DeploymentProfile) -> list[str]:
    """Both engines trace their requests to the profile's collector (docs/tracing.md); the
    simulator, like vLLM, by ``--otlp-traces-endpoint``, vLLM's detail by its own flag."""
    if not profile.otlp_traces_endpoint:
        return []
    url = checked_endpoint(profile.otlp_traces_endpoint, "otlp_traces_endpoint")
    args = ["--otlp-traces-endpoint", url]
    if profile.engine != EngineKind.SIMULATOR and profile.trace_detail != TraceDetail.NONE:
        args += ["--collect-detailed-traces", profile.trace_detail]
    return args


def tracing_env(profile: DeploymentProfile, role: str) -> dict[str, str]:
    """What a tracing engine needs beside its flags: vLLM exports over gRPC unless told
    otherwise, and the collector is OTLP/HTTP; a service name per role tells the two engines
    apart in the viewer. The profile's own ``*_env`` wins."""
    if not profile.otlp_traces_endpoint:
        return {}
    env = {"OTEL_SERVICE_NAME": f"syshax-engine-{role}"}
    if profile.engine != EngineKind.SIMULATOR:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    return env


def binds_device_cores(profile: DeploymentProfile, node: Node | None) -> bool:
    """Whether the plan's CPU ids name cores of the device the CPU engine computes on.

    They are the node's CPUs. A real engine computes on them. A simulated CPU engine computes
    on its preset (``sim_cpu_device``), whose cores the simulator numbers ``0..cores-1`` in
    NUMA order, so the node's ids are its cores only on a node of the preset's shape (the
    Kunpeng 920 host for the Kunpeng preset). Anywhere else the host's binding would shrink the
    simulated device: ``syshax up`` on a 2-core machine bound it to ``0-1``, 2 of the Kunpeng's
    160 cores, and its prefill ran 80 times slower than the device it stands for. There it
    models the whole preset, as without a binding; its process still runs in the plan's cpuset.
    """
    if profile.engine != EngineKind.SIMULATOR:
        return True
    device = DEVICES.get(profile.sim_cpu_device)
    cpu = getattr(node, "cpu", None)
    if node is None or device is None or cpu is None:
        return False
    numa_nodes = sum(1 for n in node.numa_nodes.all() if n.cpus.strip())
    return (cpu.physical_cores, numa_nodes) == (device.cores, device.numa_nodes)


def cpu_engine_env(
    profile: DeploymentProfile, plan: dict[str, Any], node: Node | None
) -> dict[str, str]:
    """Threads, binding and KV space of the CPU engine on ``node``; the profile's ``cpu_env``
    wins."""
    env = (
        thread_env(
            profile.engine,
            plan.get("omp_num_threads", ""),
            str(plan.get("custom_cpu_affinity", "")),
        )
        if binds_device_cores(profile, node)
        else {}
    )
    env["VLLM_CPU_KVCACHE_SPACE"] = str(profile.cpu_kv_cache_space_gb)
    if profile.quantization != "none":
        env["SYSHAX_QUANTIZE"] = profile.quantization
    env.update(tracing_env(profile, "cpu"))
    env.update(profile.cpu_env)
    return env


def _command(profile: DeploymentProfile, role: str) -> list[str]:
    configured = list(profile.gpu_command if role == "gpu" else profile.cpu_command)
    if configured:
        return configured
    return list(SIMULATOR_COMMAND) if profile.engine == EngineKind.SIMULATOR else []


def profile_engine_spec(
    profile: DeploymentProfile,
    role: str,
    *,
    node: Node | None,
    plan: dict[str, Any],
    names: tuple[str, str],
    cards: list[AcceleratorRow] | None = None,
) -> EngineSpec:
    """One engine of ``profile`` on ``node`` (None: no node's devices or address), named
    ``names`` = (GPU engine, CPU engine). ``engine_spec`` and ``syshax profile render`` both
    build from here, so a rendered command line is the one the agent runs."""
    host = node.engine_host if node is not None else LOOPBACK
    gpu_name, cpu_name = names
    name, peer = (gpu_name, cpu_name) if role == "gpu" else (cpu_name, gpu_name)
    args = tuple(engine_args(profile, role, engine_id=name, peer_engine_id=peer, host=host))
    if role == "gpu":
        if cards is None:  # no claim (a rendered profile): the node's first cards
            cards = (
                list(node.accelerators.order_by("index")[: profile.tensor_parallel_size])
                if node is not None
                else []
            )
        accelerators = tuple(
            Accelerator(uuid=acc.uuid, index=acc.index, simulated=acc.simulated, kind=acc.kind)
            for acc in cards
        )
        return EngineSpec(
            command=tuple(_command(profile, "gpu")),
            args=args,
            image=profile.gpu_image,
            env={**tracing_env(profile, "gpu"), **profile.gpu_env},
            port=profile.gpu_port,
            host=host,
            cpuset=plan.get("gpu_cpuset") or None,
            shm_size_bytes=int(profile.gpu_shm_size_gb * GIB),
            accelerators=accelerators,
            ipc="shareable",
            health_timeout_seconds=profile.health_timeout_seconds,
            name=name,
            kv_connector=profile.uses_kv_connector,
        )
    return EngineSpec(
        command=tuple(_command(profile, "cpu")),
        args=args,
        image=profile.cpu_image,
        env=cpu_engine_env(profile, plan, node),
        port=profile.cpu_port,
        host=host,
        cpuset=plan.get("cpuset") or None,
        memory_limit_bytes=(
            int(profile.cpu_memory_limit_gb * GIB) if profile.cpu_memory_limit_gb else None
        ),
        ipc="peer",
        health_timeout_seconds=profile.health_timeout_seconds,
        name=name,
        ipc_peer=peer,
        kv_connector=profile.uses_kv_connector,
    )


def engine_spec(deployment: Deployment, role: str) -> dict[str, Any]:
    profile = deployment.profile
    names = (
        engine_name(deployment.pk, deployment.generation, "gpu"),
        engine_name(deployment.pk, deployment.generation, "cpu"),
    )
    claimed = [
        claim.accelerator
        for claim in deployment.accelerator_claims.select_related("accelerator").order_by(
            "accelerator__index"
        )
    ]
    spec = profile_engine_spec(
        profile,
        role,
        node=deployment.node,
        plan=deployment.affinity_plan or {},
        names=names,
        cards=claimed or None,
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
