"""The Docker-Engine-API runtime (Docker, or Podman's Docker-compatible service).

What each container gets (devices, IPC namespace, cpuset, mounts) is decided by
``common.containers``, which the control plane's profile preview shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import replace

import docker
import docker.errors
from docker.models.containers import Container

from agents.runtimes import EngineRuntimeError, EngineState
from common.containers import container_kwargs
from common.engine_spec import EngineSpec, kv_connector_dir
from common.engine_spec import Mount as SpecMount
from common.hosts import HostError, http_url

_STATUS = {
    "created": "created",
    "running": "running",
    "restarting": "running",
    "paused": "running",
    "exited": "exited",
    "dead": "exited",
    "removing": "exited",
    "stopped": "exited",
    "configured": "created",
}


def _endpoint(host: str, port: str | None) -> str | None:
    """Where a container's engine listens, from the labels it was started with; none when
    they name no port or no host (common/hosts.py)."""
    if not port or not port.isdigit() or port == "0":
        return None
    try:
        return http_url(host, int(port))
    except HostError:
        return None


class DockerRuntime:
    name = "docker"

    def __init__(
        self,
        base_url: str | None = None,
        timeout: float = 60.0,
        default_mounts: Sequence[SpecMount] = (),
    ) -> None:
        # Mounts every engine gets (model caches, or the host's Python for the tiny test image),
        # configured on the agent rather than sent in each spec.
        self.default_mounts = tuple(default_mounts)
        self.client = (
            docker.DockerClient(base_url=base_url, version="auto", timeout=int(timeout))
            if base_url
            else docker.from_env(version="auto", timeout=int(timeout))
        )

    def _state(self, container: Container) -> EngineState:
        attrs = container.attrs
        state = attrs.get("State") or {}
        raw = str(state.get("Status") or container.status).lower()
        status = _STATUS.get(raw, "exited")
        labels = dict((attrs.get("Config") or {}).get("Labels") or {})
        port = labels.get("syshax.port")
        host = labels.get("syshax.host", "127.0.0.1")
        # A container running again after a restart reports exit code 0 (Podman restarts at
        # once, so a crash-looping engine is mostly seen so): its last code is then unknown.
        died = status == "exited" or raw == "restarting"
        return EngineState(
            engine_id=str(container.id),
            name=str(container.name),
            labels=labels,
            status=status,
            exit_code=int(state.get("ExitCode", 0)) if status == "exited" else None,
            restarts=int(attrs.get("RestartCount") or 0),
            endpoint=_endpoint(host, port),
            extra={"docker_status": raw, "last_exit_code": state.get("ExitCode") if died else None},
        )

    def start(
        self, name: str, spec: EngineSpec, labels: Mapping[str, str], ipc_peer: EngineState | None
    ) -> EngineState:
        role = labels.get("syshax.role", "gpu")
        # The endpoint rides in labels so a re-adopted container still knows where it listens.
        full_labels = {**labels, "syshax.port": str(spec.port), "syshax.host": spec.host}
        targets = {m.target for m in spec.mounts}
        extra = tuple(m for m in self.default_mounts if m.target not in targets)
        # A spec may name one of the agent's mounts, but never make a read-only one writable.
        read_only = {m.target for m in self.default_mounts if m.read_only}
        own = tuple(replace(m, read_only=True) if m.target in read_only else m for m in spec.mounts)
        kwargs = container_kwargs(
            name,
            replace(spec, mounts=own + extra),
            full_labels,
            role,
            ipc_peer.engine_id if ipc_peer else None,
            kv_connector_source=str(kv_connector_dir()) if spec.kv_connector else None,
        )
        try:
            container = self.client.containers.run(**kwargs)
        except docker.errors.APIError as exc:
            # A container created but not started (an image whose entrypoint cannot run) is
            # removed now, not left for the next start of this role.
            with contextlib.suppress(docker.errors.APIError):
                self.client.containers.get(name).remove(force=True)
            reason = str(exc.explanation or exc)
            if ipc_peer is not None and "ipc" in reason.lower():
                # The engine's words name the GPU container by its id only (e.g. "no such
                # container" when it went away after the agent looked).
                reason = (
                    f"the CPU engine cannot join the IPC namespace of GPU engine "
                    f"{ipc_peer.name}: {reason}"
                )
            raise EngineRuntimeError(f"container engine refused {name}: {reason}") from None
        except docker.errors.ImageNotFound as exc:  # pragma: no cover - subclass of APIError
            raise EngineRuntimeError(f"image {spec.image!r} not found: {exc}") from None
        container.reload()
        return self._state(container)

    def _get(self, engine_id: str) -> Container | None:
        try:
            return self.client.containers.get(engine_id)
        except docker.errors.NotFound:
            return None

    def inspect(self, engine_id: str) -> EngineState | None:
        container = self._get(engine_id)
        return self._state(container) if container is not None else None

    def stop(self, engine_id: str, timeout: float = 10.0) -> None:
        container = self._get(engine_id)
        if container is None:
            return
        try:
            container.stop(timeout=int(timeout))
        except docker.errors.NotFound:
            return
        except docker.errors.APIError:
            pass  # already stopped or stopping: removal below forces it
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            # e.g. a GPU engine whose IPC namespace another container still uses
            raise EngineRuntimeError(
                f"cannot remove {container.name}: {exc.explanation or exc}"
            ) from None

    def logs(self, engine_id: str, tail: int = 50) -> str:
        container = self._get(engine_id)
        if container is None:
            return ""
        raw = container.logs(tail=tail, stdout=True, stderr=True)
        return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)

    def list(self, labels: Mapping[str, str]) -> list[EngineState]:
        filters: dict[str, str | list[str] | bool] = {
            "label": [f"{k}={v}" for k, v in labels.items()]
        }
        containers = self.client.containers.list(all=True, filters=filters)
        states = [self._state(c) for c in containers]
        # Filter again: some engines implement label filters loosely.
        return [s for s in states if all(s.labels.get(k) == v for k, v in labels.items())]
