"""The engine ``spec`` of a command (docs/agent.md): its typed shape and its one validator.

The control plane builds specs (controlplane/deployments/specs.py) and the agent validates
and runs them, both with this module. :func:`kv_connector_dir` locates the installed
``kvconnector`` package without importing it: this layer imports nothing else of ours.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.hosts import ADDRESS_RULE, http_url, is_host

log = logging.getLogger(__name__)

ROLES = ("gpu", "cpu")
IPC_MODES = ("shareable", "peer", "private")
RESTART_POLICIES = ("no", "on-failure", "unless-stopped", "always")
LABEL_PREFIX = "syshax."
SIMULATED_UUID_PREFIX = "SIM-"  # agents.discovery names simulated cards SIM-<uuid>
ASCEND_UUID_PREFIX = "NPU-"  # and Ascend NPUs NPU-<serial>
# The KV connector both engines of a PD pair load (--kv-transfer-config): one self-contained
# module, made importable by the runtime from the agent's own installed copy.
KV_CONNECTOR_CLASS = "SyshaxShmConnector"
KV_CONNECTOR_MODULE = "syshax_kv_connector"
KV_CONNECTOR_CONTAINER_DIR = "/opt/syshax/kvconnector"
# Keys the control plane may add for the operator's benefit; they do not change the engine.
INFORMATIONAL_KEYS = frozenset(
    {
        "deployment",
        "deployment_id",
        "generation",
        "role",
        "engine",
        "model",
        "keep_generation",
        "tail",
    }
)


class SpecError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Accelerator:
    uuid: str
    index: int = 0
    simulated: bool = False
    kind: str = "gpu"  # "gpu" (NVIDIA device request) or "npu" (Ascend device nodes)


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class EngineSpec:
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    image: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    host: str = "127.0.0.1"
    cpuset: str | None = None
    memory_limit_bytes: int | None = None
    shm_size_bytes: int | None = None
    accelerators: tuple[Accelerator, ...] = ()
    ipc: str | None = None  # None: "shareable" for the GPU role, "peer" for the CPU role
    health_path: str = "/health"
    models_path: str | None = "/v1/models"
    health_timeout_seconds: float = 120.0
    restart_policy: str = "unless-stopped"
    mounts: tuple[Mount, ...] = ()
    working_dir: str | None = None
    name: str | None = None  # engine/container name; default syshax-<deployment>-g<gen>-<role>
    ipc_peer: str | None = None  # informational: the GPU engine's name the CPU engine joins
    kv_connector: bool = False  # the runtime puts the syshax KV connector on PYTHONPATH
    ignored_keys: tuple[str, ...] = ()

    @property
    def argv(self) -> list[str]:
        return [*self.command, *self.args]

    @property
    def endpoint(self) -> str | None:
        return http_url(self.host, self.port) if self.port else None

    def ipc_for(self, role: str) -> str:
        if self.ipc:
            return self.ipc
        return "shareable" if role == "gpu" else "peer"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["command"] = list(self.command)
        data["args"] = list(self.args)
        data["env"] = dict(self.env)
        del data["ignored_keys"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineSpec:
        # Unknown keys are not fatal (the control plane may grow informational ones); they are
        # returned in the command's output so a typo is still visible.
        fields = set(cls.__dataclass_fields__) - {"ignored_keys"}
        ignored = tuple(sorted(set(data) - fields - INFORMATIONAL_KEYS))
        command = _str_list(data.get("command"), "command")
        args = _str_list(data.get("args"), "args")
        if not command and not args:
            raise SpecError("command", "command or args is required (a list of strings)")
        port = data.get("port", 0)
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise SpecError("port", f"must be an integer 0-65535, got {port!r}")
        env = data.get("env") or {}
        if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise SpecError("env", "must map strings to strings")
        ipc = data.get("ipc")
        if ipc is not None and ipc not in IPC_MODES:
            raise SpecError("ipc", f"must be one of {', '.join(IPC_MODES)}, got {ipc!r}")
        restart = data.get("restart_policy", "unless-stopped")
        if restart not in RESTART_POLICIES:
            raise SpecError(
                "restart_policy", f"must be one of {', '.join(RESTART_POLICIES)}, got {restart!r}"
            )
        timeout = data.get("health_timeout_seconds", 120.0)
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise SpecError("health_timeout_seconds", f"must be a positive number, got {timeout!r}")
        kv_connector = data.get("kv_connector", False)
        if not isinstance(kv_connector, bool):
            raise SpecError("kv_connector", f"must be true or false, got {kv_connector!r}")
        host = data.get("host") or "127.0.0.1"
        if not isinstance(host, str) or not is_host(host):
            raise SpecError("host", f"{ADDRESS_RULE}, got {host!r}")
        for key in ("memory_limit_bytes", "shm_size_bytes"):
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise SpecError(key, f"must be a positive integer or null, got {value!r}")
        try:
            accelerators = tuple(
                _accelerator(a, i) for i, a in enumerate(data.get("accelerators") or ())
            )
            mounts = tuple(Mount(**m) for m in data.get("mounts") or ())
        except TypeError as exc:
            raise SpecError("accelerators/mounts", str(exc)) from None
        return cls(
            command=tuple(command),
            args=tuple(args),
            image=str(data.get("image") or ""),
            env=dict(env),
            port=port,
            host=host,
            cpuset=data.get("cpuset") or None,
            memory_limit_bytes=data.get("memory_limit_bytes"),
            shm_size_bytes=data.get("shm_size_bytes"),
            accelerators=accelerators,
            ipc=ipc,
            health_path=str(data.get("health_path") or "/health"),
            models_path=data.get("models_path", "/v1/models"),
            health_timeout_seconds=float(timeout),
            restart_policy=restart,
            mounts=mounts,
            working_dir=data.get("working_dir") or None,
            name=data.get("name") or None,
            ipc_peer=data.get("ipc_peer") or None,
            kv_connector=kv_connector,
            ignored_keys=ignored,
        )


def _accelerator(value: object, index: int) -> Accelerator:
    """A card as ``{"uuid", "index", "simulated"}`` or as a bare UUID string."""
    if isinstance(value, str):
        kind = "npu" if value.startswith(ASCEND_UUID_PREFIX) else "gpu"
        return Accelerator(value, index, value.startswith(SIMULATED_UUID_PREFIX), kind)
    if isinstance(value, Mapping):
        return Accelerator(**value)
    raise TypeError(f"accelerator {value!r} is neither a UUID nor an object")


def _str_list(value: object, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise SpecError(name, "must be a list of strings")
    return list(value)


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in an engine's arguments (the last)."""
    found = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def engine_name(deployment_id: int, generation: int, role: str) -> str:
    return f"syshax-{deployment_id}-g{generation}-{role}"


def engine_labels(
    *, node: str, deployment_id: int, generation: int, role: str, dispatch_id: str
) -> dict[str, str]:
    return {
        f"{LABEL_PREFIX}managed": "true",
        f"{LABEL_PREFIX}node": node,
        f"{LABEL_PREFIX}deployment": str(deployment_id),
        f"{LABEL_PREFIX}generation": str(generation),
        f"{LABEL_PREFIX}role": role,
        f"{LABEL_PREFIX}dispatch": dispatch_id,
    }


def kv_connector_dir() -> Path:
    """The directory of this installation's ``syshax_kv_connector.py`` (an agent's own copy: the
    control plane's filesystem may not be this node's). Found, not imported: the connector runs
    inside engines, beside vLLM and torch, never in our processes."""
    spec = importlib.util.find_spec("kvconnector")
    if spec is None or not spec.submodule_search_locations:
        raise SpecError(
            "kv_connector", "the kvconnector package is not installed beside this agent"
        )
    directory = Path(next(iter(spec.submodule_search_locations))).resolve()
    if not (directory / f"{KV_CONNECTOR_MODULE}.py").is_file():
        # Not fatal here: an engine that needs it fails with vLLM's own import error in its log.
        log.warning("%s.py is missing from %s", KV_CONNECTOR_MODULE, directory)
    return directory


def prepend_python_path(env: Mapping[str, str], directory: str) -> dict[str, str]:
    """``env`` with ``directory`` first on its ``PYTHONPATH``, keeping what was there."""
    existing = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (directory, existing) if p)}


# ---------------------------------------------------------------- KV connector flags


def kv_transfer_config(
    engine_id: str, peer_engine_id: str, shm_dir: str = "/dev/shm", *, arena_mib: int = 0
) -> str:
    """vLLM's ``--kv-transfer-config`` JSON for one engine of a PD pair: both engines load the
    syshax shared-memory connector as ``kv_both`` and name each other; the engine that
    prefills gets an arena of ``arena_mib`` to publish its KV in, the decode engine none."""
    return json.dumps(
        {
            "kv_connector": KV_CONNECTOR_CLASS,
            "kv_connector_module_path": KV_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "shm_dir": shm_dir,
                "lease_seconds": 30,
                "arena_mib": arena_mib,
                "engine_id": engine_id,
                "peer_engine_id": peer_engine_id,
            },
        }
    )
