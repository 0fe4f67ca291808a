"""Engine runtimes: where and how an engine process runs.

Both runtimes keep the same lifecycle semantics, so the command layer (agents/commands.py) is
written once: engines are found by their labels, a stopped engine is removed, ``inspect`` of a
vanished engine answers ``None``, and an exit code survives the agent's own restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.engine_spec import EngineSpec


class EngineRuntimeError(Exception):
    """The runtime refused or failed an operation; the message is meant for the operator."""


@dataclass
class EngineState:
    engine_id: str
    name: str
    labels: dict[str, str]
    status: str  # created | running | exited | missing
    exit_code: int | None = None
    restarts: int = 0
    endpoint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def deployment_id(self) -> int:
        return int(self.labels.get("syshax.deployment", "0"))

    @property
    def generation(self) -> int:
        return int(self.labels.get("syshax.generation", "0"))

    @property
    def role(self) -> str:
        return self.labels.get("syshax.role", "")

    def container_state(self, health: str = "unknown") -> dict[str, Any]:
        """The container-state shape of docs/machine-api.md."""
        return {
            "deployment_id": self.deployment_id,
            "generation": self.generation,
            "role": self.role,
            "engine_id": self.engine_id,
            "name": self.name,
            "status": self.status,
            "health": health,
            "exit_code": self.exit_code,
            "endpoint": self.endpoint,
        }


class Runtime(Protocol):
    name: str

    def start(
        self, name: str, spec: EngineSpec, labels: Mapping[str, str], ipc_peer: EngineState | None
    ) -> EngineState: ...

    def stop(self, engine_id: str, timeout: float = 10.0) -> None:
        """Stop the engine and remove it; an unknown engine is not an error."""

    def inspect(self, engine_id: str) -> EngineState | None: ...

    def logs(self, engine_id: str, tail: int = 50) -> str: ...

    def list(self, labels: Mapping[str, str]) -> list[EngineState]: ...
