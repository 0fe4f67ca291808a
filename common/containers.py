"""The Docker container of an engine spec: ``containers.create`` arguments and the equivalent
``docker run`` line.

Shared by the agent's Docker-API runtime (which creates the container) and the control plane's
profile preview (which shows the operator the same thing as text), so the two cannot drift.

GPU engine: device requests for its real accelerators, ``ipc_mode="shareable"`` and a sized
``/dev/shm``. CPU engine: ``ipc_mode="container:<gpu engine>"`` so both see one ``/dev/shm``
(the KV-cache handoff), a cpuset and a memory limit. Both: host networking, labels, restart
policy. NVIDIA GPUs are device requests; Ascend NPUs are their device nodes plus the host's
driver, mounted read-only. Simulated accelerators get neither: there is no device to hand
over, and a request for one would make the engine refuse to start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from docker.types import DeviceRequest, Mount

from common.engine_spec import (
    KV_CONNECTOR_CONTAINER_DIR,
    EngineSpec,
    SpecError,
    prepend_python_path,
)
from common.engine_spec import Mount as SpecMount

ASCEND_SHARED_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
ASCEND_DRIVER_PATHS = ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi")


def container_kwargs(
    name: str,
    spec: EngineSpec,
    labels: Mapping[str, str],
    role: str,
    ipc_peer_id: str | None,
    kv_connector_source: str | None = None,
) -> dict[str, Any]:
    """The ``containers.create`` keyword arguments for one engine (pure, tested on its own).

    A spec with ``kv_connector`` gets ``kv_connector_source`` (this node's directory holding
    ``syshax_kv_connector.py``) bind-mounted read-only at ``/opt/syshax/kvconnector``, first on
    the engine's ``PYTHONPATH``. The image's own ``PYTHONPATH`` is not visible here, so a
    profile that needs one sets it in its env.
    """
    ipc = spec.ipc_for(role)
    if spec.kv_connector:
        if kv_connector_source is None:
            raise SpecError("kv_connector", "no KV connector directory on this node")
        connector = SpecMount(kv_connector_source, KV_CONNECTOR_CONTAINER_DIR, read_only=True)
        others = (m for m in spec.mounts if m.target != KV_CONNECTOR_CONTAINER_DIR)
        spec = replace(
            spec,
            env=prepend_python_path(spec.env, KV_CONNECTOR_CONTAINER_DIR),
            mounts=(*others, connector),
        )
    kwargs: dict[str, Any] = {
        "image": spec.image,
        "command": spec.argv,
        "name": name,
        "labels": dict(labels),
        "environment": dict(spec.env),
        "network_mode": "host",
        "detach": True,
        "restart_policy": {"Name": spec.restart_policy}
        | ({"MaximumRetryCount": 5} if spec.restart_policy == "on-failure" else {}),
        "mounts": [
            Mount(target=m.target, source=m.source, type="bind", read_only=m.read_only)
            for m in spec.mounts
        ],
    }
    if ipc == "peer":
        if ipc_peer_id is None:
            raise SpecError("ipc", "'peer' needs the GPU engine's container")
        kwargs["ipc_mode"] = f"container:{ipc_peer_id}"
    elif ipc == "shareable":
        kwargs["ipc_mode"] = "shareable"
    else:
        kwargs["ipc_mode"] = "private"
    # Docker refuses shm_size on a container that borrows another's IPC namespace.
    if spec.shm_size_bytes and ipc != "peer":
        kwargs["shm_size"] = spec.shm_size_bytes
    if spec.cpuset:
        kwargs["cpuset_cpus"] = spec.cpuset
    if spec.memory_limit_bytes:
        kwargs["mem_limit"] = spec.memory_limit_bytes
    if spec.working_dir:
        kwargs["working_dir"] = spec.working_dir
    real = [a for a in spec.accelerators if not a.simulated]
    gpus = [a for a in real if a.kind != "npu"]
    npus = [a for a in real if a.kind == "npu"]
    if gpus:
        kwargs["device_requests"] = [
            DeviceRequest(
                driver="nvidia", device_ids=[a.uuid for a in gpus], capabilities=[["gpu"]]
            )
        ]
    if npus:
        # Ascend has no device-request driver: hand over the card's device node, the shared
        # management nodes, and the host's driver (read-only), as Ascend's container guide does.
        kwargs["devices"] = [f"/dev/davinci{a.index}:/dev/davinci{a.index}:rwm" for a in npus] + [
            f"{node}:{node}:rwm" for node in ASCEND_SHARED_DEVICES
        ]
        kwargs["mounts"] = list(kwargs["mounts"]) + [
            Mount(target=path, source=path, type="bind", read_only=True)
            for path in ASCEND_DRIVER_PATHS
        ]
    return kwargs


def _size(value: int) -> str:
    """Bytes as docker's size syntax, in the largest whole unit (``16g``, ``512m``)."""
    for unit, factor in (("g", 1024**3), ("m", 1024**2), ("k", 1024)):
        if value % factor == 0:
            return f"{value // factor}{unit}"
    return f"{value}b"


def docker_run_argv(kwargs: Mapping[str, Any], *, labels: bool = True) -> list[str]:
    """``docker run`` arguments equivalent to ``containers.run(**kwargs)`` (``container_kwargs``'
    output), so what an operator copies is what the agent would create."""
    argv = ["docker", "run", "--detach", "--name", str(kwargs["name"])]
    if kwargs.get("network_mode"):
        argv += ["--network", str(kwargs["network_mode"])]
    if kwargs.get("ipc_mode"):
        argv += ["--ipc", str(kwargs["ipc_mode"])]
    if kwargs.get("shm_size"):
        argv += ["--shm-size", _size(int(kwargs["shm_size"]))]
    if kwargs.get("cpuset_cpus"):
        argv += ["--cpuset-cpus", str(kwargs["cpuset_cpus"])]
    if kwargs.get("mem_limit"):
        argv += ["--memory", _size(int(kwargs["mem_limit"]))]
    restart = kwargs.get("restart_policy") or {}
    if restart.get("Name") and restart["Name"] != "no":
        retries = restart.get("MaximumRetryCount")
        argv += ["--restart", f"{restart['Name']}:{retries}" if retries else restart["Name"]]
    for request in kwargs.get("device_requests") or ():
        argv += ["--gpus", f'"device={",".join(request["DeviceIDs"])}"']
    for device in kwargs.get("devices") or ():
        argv += ["--device", str(device)]
    for mount in kwargs.get("mounts") or ():
        spec = f"type={mount['Type']},source={mount['Source']},target={mount['Target']}"
        argv += ["--mount", spec + (",readonly" if mount.get("ReadOnly") else "")]
    if kwargs.get("working_dir"):
        argv += ["--workdir", str(kwargs["working_dir"])]
    for key, value in (kwargs.get("environment") or {}).items():
        argv += ["--env", f"{key}={value}"]
    if labels:
        for key, value in (kwargs.get("labels") or {}).items():
            argv += ["--label", f"{key}={value}"]
    return [*argv, str(kwargs["image"]), *[str(a) for a in kwargs.get("command") or ()]]
