"""What every request reads: the router's configuration, its live view (policies,
deployments and their backends) and its metrics, bundled as ``Router``.

Policies and deployments are swapped in whole (a new dict/list object) so a request that
already read them keeps a consistent view while an update lands. The policy sources
(``router.policy``) write them; requests only read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from common.decisions import ReplicaChoice
from common.policy_schema import PolicyError, PolicyKnobs, validate_knobs
from common.routing import DeploymentSpec
from router.client.access import MODE_HEADER_BENCHMARK_KEYS
from router.client.shared_limits import DEFAULT_TIMEOUT, SharedLimits
from router.client.tenants import Tenants
from router.decide import Loads, ReplicaAsk, choose_replica
from router.engines.backends import Backend, Timeouts
from router.engines.load import UNAVAILABLE
from router.flow import FlowControl
from router.kv_events import KvEventStreams, StreamKey
from router.metrics import RouterMetrics, SharedLimitsMetrics
from router.prefix_index import PrefixIndex, chunk_tokens, prompt_chunks
from router.tracing import OFF, Tracer

log = logging.getLogger("syshax.router")


@dataclass(frozen=True)
class PolicyRecord:
    name: str
    version: int
    knobs: PolicyKnobs
    applied_at: float = field(default_factory=time.time)


@dataclass
class Deployment:
    """One deployment as the router routes to it: its GPU engine and its CPU engine, if any.
    Its PD wire protocol is named by ``spec.pd_protocol`` (``router.pd.registry``)."""

    spec: DeploymentSpec
    gpu: Backend
    cpu: Backend | None

    def loads(self, now: float) -> Loads:
        return Loads(
            gpu=self.gpu.load(now),
            cpu=self.cpu.load(now) if self.cpu is not None else UNAVAILABLE,
            gpu_itl_slope_ms=self.gpu.itl_slope_ms,
            cpu_itl_slope_ms=self.cpu.itl_slope_ms if self.cpu is not None else None,
            cpu_max_num_seqs=self.spec.cpu_max_num_seqs,
            gpu_temperature_c=self.spec.gpu_temperature_c,
            host_memory_percent=self.spec.host_memory_percent,
            cpu_inflight=self.cpu.inflight if self.cpu is not None else 0,
        )

    def pressure(self, now: float) -> float:
        """What the least-loaded replica choice compares: the router's in-flight requests
        plus the engine's queue."""
        gpu = self.gpu.load(now)
        score = float(self.gpu.inflight + gpu.waiting)
        if not gpu.available:
            score += 1e6
        if self.cpu is not None:
            score += 0.5 * self.cpu.inflight
        return score


def parse_policy(data: Any) -> PolicyRecord:
    """Validate a policy document ``{"name", "version", "knobs"}`` (or bare knobs)."""
    if not isinstance(data, dict):
        raise PolicyError("policy", "must be a JSON object")
    if "knobs" in data:
        version = data.get("version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise PolicyError("version", "must be an integer")
        name = data.get("name", "default")
        if not isinstance(name, str):
            raise PolicyError("name", "must be a string")
        return PolicyRecord(name, version, validate_knobs(data["knobs"]))
    # A standalone policy file may list just the knobs it changes.
    return PolicyRecord("default", 0, validate_knobs(data, partial=True))


class RouterState:
    def __init__(self, timeouts: Timeouts, metrics: RouterMetrics | None = None) -> None:
        self.timeouts = timeouts
        self.metrics = metrics
        # Which replica was sent which prompt prefix (the prefix-aware replica choice).
        self.prefix_index = PrefixIndex()
        # The engines' KV events, where the deployments name them: they keep the index honest.
        self.kv_events = KvEventStreams(
            self.prefix_index.forget, metrics.registry if metrics is not None else None
        )
        self.policies: dict[str, PolicyRecord] = {
            "default": PolicyRecord("default", 0, PolicyKnobs())
        }
        self.deployments: list[Deployment] = []
        self.by_model: dict[str, list[Deployment]] = {}
        self.backends: dict[str, Backend] = {}
        # Backends that left the set, until their last stream ends (then they are closed).
        self.closing: list[Backend] = []
        self._closers: set[asyncio.Task[None]] = set()

    def policy_for(self, deployment: Deployment | None) -> PolicyRecord:
        name = deployment.spec.policy if deployment is not None else "default"
        return self.policies.get(name) or self.default_policy()

    def knobs_for(self, deployment: Deployment | None, forced: PolicyKnobs | None) -> PolicyKnobs:
        """The knobs that apply to a request: those forced by its X-Syshax-Mode header, else
        the deployment's live policy (read anew each call, so a policy change lands)."""
        return forced or self.policy_for(deployment).knobs

    def set_policy(self, record: PolicyRecord) -> None:
        policies = dict(self.policies)
        policies[record.name] = record
        self.policies = policies

    def default_policy(self) -> PolicyRecord:
        return self.policies.get("default") or next(iter(self.policies.values()))

    def _backend(self, url: str, role: str) -> Backend:
        key = url.rstrip("/")
        backend = self.backends.get(key)
        if backend is None:
            backend = Backend(key, role, self.timeouts)
        return backend

    def set_deployments(self, specs: list[DeploymentSpec]) -> None:
        """Replace the deployment set, reusing the pooled backend of any URL already known."""
        deployments: list[Deployment] = []
        backends: dict[str, Backend] = {}
        for spec in specs:
            gpu = self._backend(spec.gpu_url, "gpu")
            backends[gpu.url] = gpu
            cpu = None
            if spec.cpu_url:
                cpu = self._backend(spec.cpu_url, "cpu")
                backends[cpu.url] = cpu
            deployments.append(Deployment(spec, gpu, cpu))
        removed = [b for url, b in self.backends.items() if url not in backends]
        by_model: dict[str, list[Deployment]] = {}
        for deployment in deployments:
            by_model.setdefault(deployment.spec.model, []).append(deployment)
        self.backends = backends
        self.deployments = deployments
        self.by_model = by_model
        self.prefix_index.keep_only(d.spec.id for d in deployments)
        self.kv_events.want(
            {
                (d.spec.id, role): (url, d.spec.name)
                for d in deployments
                for role, url in (
                    ("gpu", d.spec.gpu_kv_events_url),
                    ("cpu", d.spec.cpu_kv_events_url),
                )
                if url
            }
        )
        # After the new set is in place, so that requests handed over find the other replicas.
        for backend in removed:
            self._retire(backend)

    def _retire(self, backend: Backend) -> None:
        """A backend left the set: its requests without output go elsewhere now, and it is
        closed once its last stream ends - not only when the router stops."""
        requests = backend.inflight
        handed_over = backend.retire()
        log.warning(
            "%s backend %s left the deployment set: %d of its %d requests had sent no output "
            "and move to other engines",
            backend.role,
            backend.url,
            handed_over,
            requests,
        )
        self.closing.append(backend)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop, so nothing in flight: closed with the state
        closer = loop.create_task(self._close_when_idle(backend))
        self._closers.add(closer)
        closer.add_done_callback(self._closers.discard)

    async def _close_when_idle(self, backend: Backend) -> None:
        assert backend.drained is not None
        await backend.drained.wait()
        self.closing.remove(backend)
        await backend.close()
        log.info("%s backend %s closed", backend.role, backend.url)

    def choose(
        self, model: str, exclude: Collection[int] = (), body: dict[str, Any] | None = None
    ) -> Deployment | None:
        """The replica of ``model`` the decision pipeline's replica choice picks
        (``router.decide.pipeline.REPLICA``) for a request of ``body``, skipping the deployment
        ids in ``exclude`` (those a request already failed on). Under ``replica_choice:
        prefix`` the choice reads, and then records, which replica was sent the prompt's
        prefix (``router.prefix_index``)."""
        replicas = self.by_model.get(model)
        if replicas and exclude:
            replicas = [d for d in replicas if d.spec.id not in exclude]
        if not replicas:
            return None
        if len(replicas) == 1:
            return replicas[0]
        knobs = self.policy_for(replicas[0]).knobs
        chunks: tuple[int, ...] = ()
        held = None
        if body is not None and knobs.replica_choice == ReplicaChoice.PREFIX:
            chunks = prompt_chunks(body)
            if chunks:
                matched = self.prefix_index.match(chunks, [d.spec.id for d in replicas])
                held = [chunk_tokens(m, body) for m in matched]
        chosen, code = choose_replica(replicas, time.monotonic(), ReplicaAsk(knobs, held))
        if chunks:
            self.prefix_index.record(chunks, chosen.spec.id)
        if self.metrics is not None:
            self.metrics.replica_choice(code)
        return chosen

    def serving(self, key: StreamKey) -> bool:
        """Whether the engine of a KV events stream runs requests (a silent stream then is
        judged silent)."""
        replica, role = key
        for deployment in self.deployments:
            if deployment.spec.id == replica:
                backend = deployment.gpu if role == "gpu" else deployment.cpu
                return backend is not None and backend.load(time.monotonic()).running > 0
        return False

    def may_eject(self, backend: Backend) -> bool:
        """Outlier ejection never takes out the last backend still available."""
        now = time.monotonic()
        return any(b is not backend and b.available(now) for b in self.backends.values())

    async def close(self) -> None:
        await self.kv_events.close()
        for closer in list(self._closers):
            closer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closer
        for backend in list(self.backends.values()) + self.closing:
            await backend.close()


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_body_bytes: int = 10 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Keys that get in like the API key and may force a policy mode (router/client/access.py).
    benchmark_keys: tuple[str, ...] = ()
    # Who may force a policy mode with X-Syshax-Mode: benchmark-keys, all or off.
    mode_header: str = MODE_HEADER_BENCHMARK_KEYS
    # The token /metrics asks for (``--metrics-token``); None: /metrics is open and leaves
    # out the per-tenant series (router/api/endpoints.py).
    metrics_token: str | None = None
    # The Redis the tenants' limits are shared through (``--shared-limits-url``), and how long
    # an admission waits for it before the router holds the limits locally; None: local only.
    shared_limits_url: str | None = None
    shared_limits_timeout: float = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class ControlPlaneLink:
    """A managed router's control plane: its base URL and the router's token there (the
    Batch API's paths are forwarded to it, router/api/batches.py)."""

    base_url: str
    token: str


class Router:
    """Everything a request reads: configuration, live state and metrics."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.state = RouterState(config.timeouts, self.metrics)
        # Who may call, as what tenant, within which limits; the policy source loads the table.
        self.shared_limits = (
            SharedLimits(
                config.shared_limits_url,
                SharedLimitsMetrics(self.metrics.registry),
                config.shared_limits_timeout,
            )
            if config.shared_limits_url
            else None
        )
        self.tenants = Tenants(
            config.api_key, config.benchmark_keys, self.metrics, shared=self.shared_limits
        )
        # The class queues requests wait in while their deployment is saturated.
        self.flow = FlowControl(self.metrics)
        # Set by the managed policy source; None for a standalone router.
        self.control_plane: ControlPlaneLink | None = None
        # Begins each request's trace; off unless the router was started with an OTLP
        # endpoint (router/tracing, docs/tracing.md).
        self.tracer: Tracer = OFF


# Where the aiohttp app keeps its ``Router`` for the handlers.
ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
