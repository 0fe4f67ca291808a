"""The routing payload: what ``GET routing/deployments`` tells every router.

The control plane builds each entry as a ``DeploymentSpec`` and sends ``as_api()``; the
router reads the answer with ``parse_deployments``, the one validator, which names the field
that is wrong. Both sides use these definitions, so a field added here reaches both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The PD wire protocols a deployment's engines may speak (docs/router.md).
PD_PROTOCOLS = ("syshax", "vllm")
# The deployment states a router sends requests to.
ROUTABLE_STATES = frozenset({"running"})
# Where a router may hear an engine's KV events (docs/router.md, "KV events").
KV_EVENTS_SCHEMES = ("tcp://", "ipc://")


@dataclass(frozen=True)
class DeploymentSpec:
    """One routable deployment, as the control plane sends it (or the router's standalone
    flags describe it)."""

    id: int
    name: str
    model: str
    policy: str
    pd_protocol: str
    gpu_url: str
    cpu_url: str | None
    # The CPU engine's --max-num-seqs; None when the control plane does not say (older ones).
    cpu_max_num_seqs: int | None = None
    # The node's readings the deciders treat as limits (None: not reported).
    gpu_temperature_c: float | None = None
    host_memory_percent: float | None = None
    generation: int = 0
    state: str = "running"
    # Every engine of the deployment runs vLLM's --scheduling-policy priority: the router
    # sends each request's SLO class priority (vLLM refuses a non-zero one otherwise).
    priority_scheduling: bool = False
    # Where each engine publishes vLLM's KV events (its --kv-events-config endpoint as a
    # subscriber reaches it, tcp://host:port); None: it publishes none, or nobody said.
    gpu_kv_events_url: str | None = None
    cpu_kv_events_url: str | None = None

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> DeploymentSpec:
        """Parse one entry of ``routing/deployments``; raises ValueError naming the bad field."""

        def text(key: str, required: bool = True) -> str | None:
            value = data.get(key)
            if value is None or value == "":
                if required:
                    raise ValueError(f"deployment field {key!r} is required")
                return None
            if not isinstance(value, str):
                raise ValueError(f"deployment field {key!r} must be a string")
            return value

        protocol = text("pd_protocol", required=False) or "vllm"
        if protocol not in PD_PROTOCOLS:
            raise ValueError(f"deployment pd_protocol must be one of {PD_PROTOCOLS}")
        ident = data.get("id", 0)
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise ValueError("deployment field 'id' must be an integer")
        generation = data.get("generation", 0)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise ValueError("deployment field 'generation' must be a non-negative integer")
        cpu_limit = data.get("cpu_max_num_seqs")
        if cpu_limit is not None and (
            not isinstance(cpu_limit, int) or isinstance(cpu_limit, bool) or cpu_limit < 1
        ):
            raise ValueError("deployment field 'cpu_max_num_seqs' must be a positive integer")
        telemetry = data.get("telemetry") or {}
        if not isinstance(telemetry, dict):
            raise ValueError("deployment field 'telemetry' must be an object")

        def reading(key: str) -> float | None:
            value = telemetry.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"deployment telemetry {key!r} must be a number")
            return float(value)

        def zmq_url(key: str) -> str | None:
            value = text(key, required=False)
            if value is not None and not value.startswith(KV_EVENTS_SCHEMES):
                raise ValueError(f"deployment field {key!r} must be a tcp:// or ipc:// URL")
            return value

        priority_scheduling = data.get("priority_scheduling", False)
        if not isinstance(priority_scheduling, bool):
            raise ValueError("deployment field 'priority_scheduling' must be a boolean")
        return cls(
            id=ident,
            name=text("name") or "",
            model=text("model") or "",
            policy=text("policy", required=False) or "default",
            pd_protocol=protocol,
            gpu_url=text("gpu_url") or "",
            cpu_url=text("cpu_url", required=False),
            cpu_max_num_seqs=cpu_limit,
            gpu_temperature_c=reading("gpu_temperature_c"),
            host_memory_percent=reading("host_memory_percent"),
            generation=generation,
            state=text("state", required=False) or "running",
            priority_scheduling=priority_scheduling,
            gpu_kv_events_url=zmq_url("gpu_kv_events_url"),
            cpu_kv_events_url=zmq_url("cpu_kv_events_url"),
        )

    def as_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "model": self.model,
            "policy": self.policy,
            "pd_protocol": self.pd_protocol,
            "generation": self.generation,
            "state": self.state,
            "gpu_url": self.gpu_url,
            "cpu_url": self.cpu_url,
            "cpu_max_num_seqs": self.cpu_max_num_seqs,
            "priority_scheduling": self.priority_scheduling,
            "gpu_kv_events_url": self.gpu_kv_events_url,
            "cpu_kv_events_url": self.cpu_kv_events_url,
            "telemetry": {
                "gpu_temperature_c": self.gpu_temperature_c,
                "host_memory_percent": self.host_memory_percent,
            },
        }


def schedules_by_priority(args: Sequence[str]) -> bool:
    """Whether an engine's command line (``--scheduling-policy priority`` or
    ``--scheduling-policy=priority``, the last one given wins) makes it schedule by the
    requests' ``priority`` field."""
    policy = None
    for i, arg in enumerate(args):
        if arg == "--scheduling-policy" and i + 1 < len(args):
            policy = args[i + 1]
        elif arg.startswith("--scheduling-policy="):
            policy = arg.partition("=")[2]
    return policy == "priority"


def parse_deployments(data: Any) -> list[DeploymentSpec]:
    """The routable deployments of a ``routing/deployments`` answer (or of a standalone
    router's deployments file, the same document); a ValueError naming the entry and the
    field if malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("deployments"), list):
        raise ValueError("expected {'deployments': [...]}")
    specs = []
    for index, entry in enumerate(data["deployments"]):
        if not isinstance(entry, dict):
            raise ValueError(f"deployments[{index}]: each deployment must be an object")
        state = entry.get("state", "running")
        if state is not None and not isinstance(state, str):
            raise ValueError(f"deployments[{index}]: deployment field 'state' must be a string")
        if state not in ROUTABLE_STATES:
            continue  # not validated: a router never reads it
        try:
            specs.append(DeploymentSpec.from_api(entry))
        except ValueError as exc:  # which entry, for a list written by hand (a standalone file)
            raise ValueError(f"deployments[{index}]: {exc}") from None
    return specs
