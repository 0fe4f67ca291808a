"""The pod of a deployment's engines: one builder, pure, for the Kubernetes runtime and for
``syshax profile render NAME --kubernetes`` (docs/kubernetes.md, decision 62).

A pair pod holds the GPU engine as a native sidecar (an init container with ``restartPolicy:
Always`` and a startup probe on its health path), so the CPU engine, the pod's container,
starts only once the GPU engine answers; both share the pod's IPC namespace and its
``/dev/shm``, an in-memory ``emptyDir`` sized for the KV arena. Every container's requests
equal its limits (the pod is Guaranteed), and the engines ask for whole CPUs: the kubelet's
static CPU manager then gives each engine CPUs of its own. Accelerators are the device
plugins' resources. The pod runs on the host network, as the Docker runtime's containers do,
so the engines listen on the addresses and ports the control plane placed them on.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common import __version__
from common.affinity import AffinityError, parse_cpu_list
from common.engine_spec import (
    KV_CONNECTOR_CONTAINER_DIR,
    EngineSpec,
    Mount,
    SpecError,
    flag_value,
    prepend_python_path,
)

GIB = 1024**3
MIB = 1024**2
ENGINES_ANNOTATION = "syshax.io/engines"  # the engines a pod was made of, as JSON
MANAGED_BY = "syshax-agent"
PROJECT_IMAGE = f"syshax-controlplane:{__version__}"  # where the KV connector comes from
# The CPU lists of the placement plan name the node's CPUs; in a pod the CPU manager picks
# them, so the engine binds its threads to the CPUs it is given instead.
CONNECTOR_MODULES = (
    "syshax_kv_*.py"  # kvconnector/: the modules engines load (with syshax_kv_connector)
)
THREAD_BINDING_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "CUSTOM_CPU_AFFINITY")
SHM_HEADROOM = GIB  # /dev/shm beyond the KV arena: the engines' own shared memory
PROBE_PERIOD_SECONDS = 5
RESTART_POLICIES = {"no": "Never", "on-failure": "OnFailure"}  # anything else: Always
DNS_LABEL = re.compile(r"[^a-z0-9-]+")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class PodOptions:
    """What the agent's configuration adds to every engine pod."""

    namespace: str = "syshax-engines"
    node: str | None = None  # the Kubernetes node the pods are tied to (the agent's)
    connector_image: str = PROJECT_IMAGE
    model_claim: str | None = None  # a PersistentVolumeClaim holding the models ...
    model_root: str = "/models"  # ... mounted here, read-only
    gpu_resource: str = "nvidia.com/gpu"
    npu_resource: str = "huawei.com/Ascend910"  # the Ascend device plugin's name for the card
    engine_memory_bytes: int = 16 * GIB  # host memory of an engine whose spec sets none
    host_mounts: tuple[Mount, ...] = ()  # the agent's --mount paths, as hostPath volumes
    managed: bool = True  # the agent's labels and record; a rendered pod has neither


@dataclass(frozen=True)
class PodEngine:
    role: str  # gpu | cpu: also the container's name
    name: str  # the engine's name (syshax-<deployment>-g<generation>-<role>)
    spec: EngineSpec
    labels: Mapping[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "name": self.name,
            "labels": dict(self.labels),
            "spec": self.spec.to_dict(),
        }

    @classmethod
    def from_record(cls, item: Mapping[str, Any]) -> PodEngine:
        return cls(
            role=str(item["role"]),
            name=str(item["name"]),
            spec=EngineSpec.from_dict(item["spec"]),
            labels={str(k): str(v) for k, v in dict(item.get("labels") or {}).items()},
        )


def pod_name(engines: Sequence[PodEngine]) -> str:
    """The pod's name: the first engine's without its role (``syshax-7-g2-gpu`` makes pod
    ``syshax-7-g2``), as a DNS label."""
    first = engines[0]
    base = first.name.removesuffix(f"-{first.role}")
    return DNS_LABEL.sub("-", base.lower()).strip("-")[:63] or "syshax-engine"


def selector_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The Kubernetes labels that select the pods of engines with ``labels``: the agent's
    mark, and the deployment and generation when given. The rest of an engine's labels (its
    node, its cards, its dispatch) may not be valid label values and live in the record."""
    out = {"app.kubernetes.io/managed-by": MANAGED_BY}
    for key in ("deployment", "generation"):
        value = labels.get(f"syshax.{key}")
        if value is not None and LABEL_VALUE.match(value) and len(value) <= 63:
            out[f"syshax.io/{key}"] = value
    return out


def quantity(value: int) -> str:
    """Bytes as a Kubernetes quantity in the largest whole binary unit (``16Gi``)."""
    for unit, factor in (("Gi", GIB), ("Mi", MIB), ("Ki", 1024)):
        if value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def _parse_quantity(text: str) -> float:
    units = {"Ki": 1024, "Mi": MIB, "Gi": GIB, "Ti": 1024 * GIB, "m": 0.001}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def pod_requests(pod: Mapping[str, Any]) -> tuple[float, int, list[str]]:
    """(CPUs, memory bytes, ["2 nvidia.com/gpu", …]) the pod's engines ask for together."""
    spec = pod.get("spec") or {}
    cpus, memory = 0.0, 0
    devices: dict[str, int] = {}
    containers = list(spec.get("containers") or [])
    containers += [c for c in spec.get("initContainers") or [] if c.get("restartPolicy")]
    for container in containers:
        requests = (container.get("resources") or {}).get("requests") or {}
        cpus += _parse_quantity(str(requests.get("cpu", "0")))
        memory += int(_parse_quantity(str(requests.get("memory", "0"))))
        for key, value in requests.items():
            if key not in ("cpu", "memory"):
                devices[key] = devices.get(key, 0) + int(value)
    return cpus, memory, [f"{n} {k}" for k, n in sorted(devices.items())]


def arena_bytes(spec: EngineSpec) -> int:
    """The KV arena the engine publishes in /dev/shm (its ``--kv-transfer-config``)."""
    raw = flag_value(spec.args, "--kv-transfer-config")
    try:
        extra = json.loads(raw).get("kv_connector_extra_config", {}) if raw else {}
        return int(extra.get("arena_mib") or 0) * MIB
    except (ValueError, AttributeError, TypeError):
        return 0


def shm_bytes(engines: Sequence[PodEngine]) -> int:
    """/dev/shm's size: the GPU engine's shm size or the arena with headroom, the larger."""
    sizes = [e.spec.shm_size_bytes or 0 for e in engines]
    arenas = [arena_bytes(e.spec) for e in engines]
    arena = max(arenas, default=0)
    return max([*sizes, arena + SHM_HEADROOM if arena else 0, SHM_HEADROOM])


def _whole_cpus(spec: EngineSpec) -> int:
    """The engine's CPUs from its placement (the cpuset the plan gave it), else its thread
    binding, else one."""
    for text in (spec.cpuset, *(spec.env.get(k) for k in THREAD_BINDING_ENV)):
        if text:
            try:
                return max(1, len(parse_cpu_list(text.replace("|", ","), field_name="cpuset")))
            except AffinityError as exc:
                raise SpecError("cpuset", str(exc)) from None
    return 1


def _memory(engine: PodEngine, options: PodOptions, shm: int) -> int:
    spec = engine.spec
    if spec.memory_limit_bytes:
        return spec.memory_limit_bytes
    memory = options.engine_memory_bytes
    if engine.role == "gpu":
        memory += shm  # the arena's pages count against the engine that writes them
    else:
        kv = spec.env.get("VLLM_CPU_KVCACHE_SPACE", "")
        memory += int(kv) * GIB if kv.isdigit() else 0
    return memory


def _devices(spec: EngineSpec, options: PodOptions) -> dict[str, str]:
    real = [a for a in spec.accelerators if not a.simulated]
    gpus = sum(1 for a in real if a.kind != "npu")
    npus = sum(1 for a in real if a.kind == "npu")
    out = {}
    if gpus:
        out[options.gpu_resource] = str(gpus)
    if npus:
        out[options.npu_resource] = str(npus)
    return out


def _model_volume(
    engines: Sequence[PodEngine], options: PodOptions
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The model's volume and its mount: the claim at ``model_root``, or the model's own
    directory on the node (hostPath); none for a model the engine fetches by its hub id."""
    models = {flag_value(e.spec.args, "--model") for e in engines} - {None}
    model = next((m for m in sorted(models, key=str) if m and m.startswith("/")), None)
    if model is None:
        return None
    model = posixpath.normpath(model)
    if options.model_claim:
        root = posixpath.normpath(options.model_root)
        if not model.startswith(root.rstrip("/") + "/"):
            raise SpecError(
                "args",
                f"--model {model} is not under {root}, where claim {options.model_claim} is "
                "mounted (the agent's --kubernetes-model-root)",
            )
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": options.model_claim}}
        return volume, {"name": "model", "mountPath": root, "readOnly": True}
    volume = {"name": "model", "hostPath": {"path": model, "type": "Directory"}}
    return volume, {"name": "model", "mountPath": model, "readOnly": True}


def _probe(spec: EngineSpec) -> dict[str, Any]:
    action: dict[str, Any] = {"path": spec.health_path, "port": spec.port}
    if spec.host not in ("0.0.0.0", "::"):
        action["host"] = spec.host  # host network: the engine listens on the node's address
    return {
        "httpGet": action,
        "periodSeconds": PROBE_PERIOD_SECONDS,
        "timeoutSeconds": 2,
        "failureThreshold": max(1, math.ceil(spec.health_timeout_seconds / PROBE_PERIOD_SECONDS)),
    }


def _container(
    engine: PodEngine, options: PodOptions, mounts: list[dict[str, Any]], shm: int
) -> dict[str, Any]:
    spec = engine.spec
    env = {k: v for k, v in spec.env.items() if k not in THREAD_BINDING_ENV}
    if spec.kv_connector:
        env = prepend_python_path(env, KV_CONNECTOR_CONTAINER_DIR)
    if not spec.image:
        raise SpecError("image", f"the {engine.role.upper()} engine has no image: a pod needs one")
    cpus = _whole_cpus(spec)
    limits = {"cpu": str(cpus), "memory": quantity(_memory(engine, options, shm))}
    limits |= _devices(spec, options)
    container: dict[str, Any] = {"name": engine.role, "image": spec.image}
    if spec.command:
        container["command"] = list(spec.command)
    if spec.args:
        container["args"] = list(spec.args)
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if spec.port:
        container["ports"] = [{"name": engine.role, "containerPort": spec.port}]
    if spec.working_dir:
        container["workingDir"] = spec.working_dir
    container["resources"] = {"requests": dict(limits), "limits": limits}
    container["volumeMounts"] = [dict(m) for m in mounts]  # each its own (no YAML aliases)
    return container


def _connector_copier(options: PodOptions) -> dict[str, Any]:
    """An init container of the project's image that copies the KV connector's modules into
    the volume the engines load them from."""
    script = (
        "import glob, os, shutil, kvconnector; "
        "here = os.path.dirname(kvconnector.__file__); "
        f"[shutil.copy(p, {KV_CONNECTOR_CONTAINER_DIR!r}) "
        f"for p in glob.glob(os.path.join(here, {CONNECTOR_MODULES!r}))]"
    )
    return {
        "name": "kv-connector",
        "image": options.connector_image,
        "command": ["python", "-c", script],
        "resources": {
            "requests": {"cpu": "100m", "memory": "64Mi"},
            "limits": {"cpu": "100m", "memory": "64Mi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": 999,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "kv-connector", "mountPath": KV_CONNECTOR_CONTAINER_DIR}],
    }


def _volumes(
    engines: Sequence[PodEngine], options: PodOptions, shm: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the mounts every engine gets."""
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(shm)}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if any(e.spec.kv_connector for e in engines):
        volumes.append({"name": "kv-connector", "emptyDir": {"sizeLimit": "16Mi"}})
        mounts.append(
            {"name": "kv-connector", "mountPath": KV_CONNECTOR_CONTAINER_DIR, "readOnly": True}
        )
    model = _model_volume(engines, options)
    targets = {m["mountPath"] for m in mounts}
    if model is not None:
        volumes.append(model[0])
        mounts.append(model[1])
        targets.add(model[1]["mountPath"])
    host: dict[str, Mount] = {m.target: m for m in options.host_mounts}
    for engine in engines:
        host.update({m.target: m for m in engine.spec.mounts})
    if any(a.kind == "npu" and not a.simulated for e in engines for a in e.spec.accelerators):
        # lazy: common.containers loads the Docker client library, needed here for one list
        from common.containers import ASCEND_DRIVER_PATHS

        host.update({p: Mount(p, p, read_only=True) for p in ASCEND_DRIVER_PATHS})
    for index, (target, mount) in enumerate(sorted(host.items())):
        if target in targets:
            continue
        name = f"host-{index}"
        volumes.append({"name": name, "hostPath": {"path": mount.source}})
        mounts.append({"name": name, "mountPath": target, "readOnly": mount.read_only})
    return volumes, mounts


def _metadata(engines: Sequence[PodEngine], options: PodOptions) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "syshax-engine", "app.kubernetes.io/component": "engines"}
    metadata: dict[str, Any] = {"name": pod_name(engines), "namespace": options.namespace}
    if options.managed:
        labels |= selector_labels(engines[0].labels)
        metadata["annotations"] = {
            ENGINES_ANNOTATION: json.dumps([e.record() for e in engines], sort_keys=True)
        }
    metadata["labels"] = labels
    return metadata


def engine_pod(engines: Sequence[PodEngine], options: PodOptions) -> dict[str, Any]:
    """The pod of ``engines`` (the GPU engine, then the CPU engine joining its IPC namespace;
    or one engine alone) as the API's JSON object. Raises ``SpecError`` naming the field."""
    if not engines:
        raise SpecError("role", "a pod needs an engine")
    shm = shm_bytes(engines)
    volumes, mounts = _volumes(engines, options, shm)
    containers = [_container(e, options, mounts, shm) for e in engines]
    init: list[dict[str, Any]] = []
    if any(e.spec.kv_connector for e in engines):
        init.append(_connector_copier(options))
    if len(engines) > 1:
        # The first engine (the GPU's) as a native sidecar: it starts first, and the next
        # starts once its startup probe passes; it keeps running beside them.
        sidecar = containers.pop(0)
        sidecar["restartPolicy"] = "Always"
        if engines[0].spec.port:
            sidecar["startupProbe"] = _probe(engines[0].spec)
        init.append(sidecar)
    spec: dict[str, Any] = {
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "restartPolicy": RESTART_POLICIES.get(engines[-1].spec.restart_policy, "Always"),
        "terminationGracePeriodSeconds": 30,
    }
    if options.node:
        # Tied to the agent's node through the scheduler (as a DaemonSet's pods are), so its
        # answer, e.g. too few free GPUs, is the pod's condition rather than a kubelet refusal.
        term = {"key": "metadata.name", "operator": "In", "values": [options.node]}
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchFields": [term]}]
                }
            }
        }
    resources = {k for c in containers + init for k in c["resources"]["limits"]}
    spec["tolerations"] = [
        {"key": key, "operator": "Exists", "effect": "NoSchedule"}
        for key in sorted(resources - {"cpu", "memory"})
    ]
    if not spec["tolerations"]:
        del spec["tolerations"]
    if init:
        spec["initContainers"] = init
    spec["containers"] = containers
    spec["volumes"] = volumes
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(engines, options),
        "spec": spec,
    }


__all__ = [
    "ENGINES_ANNOTATION",
    "MANAGED_BY",
    "PodEngine",
    "PodOptions",
    "engine_pod",
    "pod_name",
    "pod_requests",
    "quantity",
    "selector_labels",
]
