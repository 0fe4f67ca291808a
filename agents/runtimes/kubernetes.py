"""The Kubernetes runtime: a deployment's engines as one pod on the agent's node.

The agent runs as a DaemonSet pod on an accelerator node (docs/kubernetes.md) and asks the API
server for engine pods in one namespace, so the scheduler, the device plugin and the CPU
manager see every engine. The pod is the Kubernetes form of ``--ipc container:<gpu>``: its
containers share an IPC namespace, and ``/dev/shm`` is an in-memory ``emptyDir`` sized for the
KV arena. The GPU engine is a native sidecar (an init container that keeps running) with a
startup probe, so the kubelet starts the CPU engine only once the GPU engine answers.

The command protocol starts the GPU engine, waits for its health, then starts the CPU engine
(agents/commands.py), and a pod's containers are fixed when it is created: the GPU start makes
a pod of the GPU engine alone, and the CPU start replaces it, under the same name, with the
pair pod built from the GPU engine's recorded spec and the CPU engine's (decision 62).

:func:`engine_pod` is the one builder: the runtime creates what it returns, and
``syshax profile render NAME --kubernetes`` prints it. The Kubernetes client is imported only
when the runtime is built, so agents on other runtimes, and the render, do without it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from agents.runtimes import EngineRuntimeError, EngineState
from agents.runtimes.kubernetes_pod import (
    ENGINES_ANNOTATION,
    PodEngine,
    PodOptions,
    engine_pod,
    pod_name,
    pod_requests,
    quantity,
    selector_labels,
)
from common.engine_spec import EngineSpec
from common.hosts import HostError, http_url

# Container waiting reasons after which the engine will not come up without a change.
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONFIG_FAILURES = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
DELETE_WAIT_SECONDS = 120.0  # beyond the grace period: how long a deleted pod may take to go


@dataclass(frozen=True)
class NodeCapacity:
    """What the agent's node has, as its own inventory sees it (the host's /proc)."""

    cpus: int
    memory_bytes: int

    @classmethod
    def of_this_host(cls) -> NodeCapacity:
        return cls(cpus=os.cpu_count() or 1, memory_bytes=int(psutil.virtual_memory().total))


class KubernetesRuntime:
    name = "kubernetes"

    def __init__(
        self,
        options: PodOptions,
        *,
        configuration: Any = None,
        capacity: NodeCapacity | None = None,
        delete_wait: float = DELETE_WAIT_SECONDS,
        poll_interval: float = 0.5,
    ) -> None:
        """``configuration`` is a ``kubernetes.client.Configuration``; without one the agent's
        ServiceAccount (in a pod) or the local kubeconfig is used."""
        try:
            # Not a first-party import: the optional client library, loaded by this runtime only.
            import kubernetes.client
            import kubernetes.config as kube_config
        except ImportError:
            raise EngineRuntimeError(
                "the kubernetes runtime needs the Kubernetes client: pip install kubernetes"
            ) from None
        if not options.node:
            raise EngineRuntimeError(
                "the kubernetes runtime needs the agent's node name: --kubernetes-node or "
                "SYSHAX_KUBERNETES_NODE (the DaemonSet sets it from spec.nodeName)"
            )
        if configuration is None:
            configuration = kubernetes.client.Configuration()
            loaders: Any = kube_config  # the client's loaders carry no annotations
            try:
                loaders.load_incluster_config(client_configuration=configuration)
            except loaders.ConfigException:
                try:
                    loaders.load_kube_config(
                        config_file=os.environ.get("KUBECONFIG"),
                        client_configuration=configuration,
                    )
                except (loaders.ConfigException, OSError) as exc:
                    raise EngineRuntimeError(
                        "the kubernetes runtime finds no API server: not in a pod with a "
                        f"ServiceAccount, and no usable kubeconfig ({exc})"
                    ) from None
        self.options = options
        self.namespace = options.namespace
        self.api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))
        self.api_error: type[Exception] = kubernetes.client.ApiException
        self.host = str(configuration.host)
        self.capacity = capacity or NodeCapacity.of_this_host()
        self.delete_wait = delete_wait
        self.poll_interval = poll_interval

    # ------------------------------------------------------------ the API, with our errors

    def _call(self, verb: str, resource: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """One API call, its JSON answer decoded; a refusal of the ServiceAccount's rights or an
        unreachable API server becomes one line naming what was asked. A 404 is raised as is."""
        try:
            answer = fn(*args, _preload_content=False, **kw)
        except self.api_error as exc:
            status = int(getattr(exc, "status", 0) or 0)
            if status in (401, 403):
                raise EngineRuntimeError(
                    f"the agent's ServiceAccount may not {verb} {resource} in namespace "
                    f"{self.namespace} ({_api_message(exc)}); grant it in the agent's Role"
                ) from None
            raise
        except OSError as exc:  # urllib3's connection errors are OSErrors
            raise EngineRuntimeError(f"Kubernetes API at {self.host} unreachable: {exc}") from None
        data = answer.data
        return json.loads(data) if verb != "get logs of" else data.decode(errors="replace")

    def _status(self, exc: Exception) -> int:
        return int(getattr(exc, "status", 0) or 0)

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            pod: dict[str, Any] = self._call(
                "get", "pods", self.api.read_namespaced_pod, name, self.namespace
            )
        except self.api_error as exc:
            if self._status(exc) == 404:
                return None
            raise EngineRuntimeError(f"cannot read pod {name}: {_api_message(exc)}") from None
        return pod

    def _pods(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(labels).items())
        try:
            answer = self._call(
                "list",
                "pods",
                self.api.list_namespaced_pod,
                self.namespace,
                label_selector=selector,
            )
        except self.api_error as exc:
            raise EngineRuntimeError(f"cannot list pods: {_api_message(exc)}") from None
        return list(answer.get("items") or [])

    def _delete(self, name: str, grace: float) -> None:
        """Delete the pod and wait until it is gone: its cards and CPUs are free only then."""
        try:
            self._call(
                "delete",
                "pods",
                self.api.delete_namespaced_pod,
                name,
                self.namespace,
                grace_period_seconds=max(0, int(grace)),
            )
        except self.api_error as exc:
            if self._status(exc) == 404:
                return
            raise EngineRuntimeError(f"cannot delete pod {name}: {_api_message(exc)}") from None
        deadline = time.monotonic() + grace + self.delete_wait
        while self._read(name) is not None:
            if time.monotonic() >= deadline:
                raise EngineRuntimeError(
                    f"pod {name} is still terminating {grace + self.delete_wait:g} s after its "
                    "deletion (is its node lost? kubectl delete pod --force removes it)"
                )
            time.sleep(self.poll_interval)

    # ------------------------------------------------------------ Runtime

    def start(
        self, name: str, spec: EngineSpec, labels: Mapping[str, str], ipc_peer: EngineState | None
    ) -> EngineState:
        role = labels.get("syshax.role", "gpu")
        engine = PodEngine(role=role, name=name, spec=spec, labels=dict(labels))
        engines = [engine]
        if ipc_peer is not None:
            # The CPU engine joins the GPU engine's pod: the pod is made again as the pair.
            peer_pod, peer_role = _split(ipc_peer.engine_id)
            current = self._read(peer_pod)
            recorded = {e.role: e for e in _recorded(current)} if current else {}
            if peer_role not in recorded:
                raise EngineRuntimeError(
                    f"the CPU engine cannot join the IPC namespace of GPU engine {ipc_peer.name}: "
                    f"pod {peer_pod} is gone"
                )
            engines = [recorded[peer_role], engine]
        pod = engine_pod(engines, self.options)
        pod_id = str(pod["metadata"]["name"])
        self._refuse_what_cannot_fit(pod)
        existing = self._read(pod_id)
        if existing is not None:
            self._delete(pod_id, grace=_grace(existing))
        try:
            self._call("create", "pods", self.api.create_namespaced_pod, self.namespace, pod)
        except self.api_error as exc:
            raise EngineRuntimeError(
                f"the API server refused pod {pod_id}: {_api_message(exc)}"
            ) from None
        state = self.inspect(f"{pod_id}/{role}")
        if state is None:
            raise EngineRuntimeError(f"pod {pod_id} vanished right after its creation")
        return state

    def _refuse_what_cannot_fit(self, pod: Mapping[str, Any]) -> None:
        cpus, memory, devices = pod_requests(pod)
        capacity = self.capacity
        if cpus <= capacity.cpus and memory <= capacity.memory_bytes:
            return
        asked = ", ".join([f"{cpus:g} CPUs", quantity(memory), *devices])
        raise EngineRuntimeError(
            f"pod {pod['metadata']['name']} cannot fit node {self.options.node}: it requests "
            f"{asked}; the node has {capacity.cpus} CPUs and {quantity(capacity.memory_bytes)} "
            "of memory in all"
        )

    def inspect(self, engine_id: str) -> EngineState | None:
        pod_id, role = _split(engine_id)
        pod = self._read(pod_id)
        if pod is None:
            return None
        for engine in _recorded(pod):
            if engine.role == role:
                return engine_state(pod, engine)
        return None

    def stop(self, engine_id: str, timeout: float = 10.0) -> None:
        # A pod's containers cannot be removed one by one: stopping either engine of a pair
        # removes the pod (the command layer stops the CPU engine first, then the GPU one).
        pod_id, _ = _split(engine_id)
        self._delete(pod_id, grace=timeout)

    def logs(self, engine_id: str, tail: int = 50) -> str:
        pod_id, role = _split(engine_id)
        pod = self._read(pod_id)
        if pod is None:
            return ""
        status = _container_status(pod, role)
        restarted = int(status.get("restartCount") or 0) > 0
        waiting = (status.get("state") or {}).get("waiting") or {}
        previous = restarted and "running" not in (status.get("state") or {})
        text = ""
        if status and not (waiting and not restarted):
            try:
                text = self._call(
                    "get logs of",
                    "pods/log",
                    self.api.read_namespaced_pod_log,
                    pod_id,
                    self.namespace,
                    container=role,
                    tail_lines=tail,
                    previous=previous,
                )
            except self.api_error:
                text = ""  # not started yet, or its node is gone with the log
        cause = pod_cause(pod, role)
        return "\n".join(part for part in (text.rstrip("\n"), cause) if part)

    def list(self, labels: Mapping[str, str]) -> list[EngineState]:
        states = []
        for pod in self._pods(labels):
            for engine in _recorded(pod):
                if all(engine.labels.get(k) == v for k, v in labels.items()):
                    states.append(engine_state(pod, engine))
        return states


# ---------------------------------------------------------------- pod status -> engine state


def _split(engine_id: str) -> tuple[str, str]:
    pod_id, _, role = engine_id.partition("/")
    return pod_id, role or "gpu"


def _recorded(pod: Mapping[str, Any]) -> list[PodEngine]:
    """The engines a pod was made of, from the annotation the runtime wrote."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ENGINES_ANNOTATION)
    if not raw:
        return []
    try:
        return [PodEngine.from_record(item) for item in json.loads(raw)]
    except (ValueError, TypeError, KeyError):
        return []


def _container_status(pod: Mapping[str, Any], container: str) -> dict[str, Any]:
    status = pod.get("status") or {}
    for item in _statuses(status):
        if item.get("name") == container:
            return dict(item)
    return {}


def _statuses(status: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield from status.get("initContainerStatuses") or ()
    yield from status.get("containerStatuses") or ()


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == kind:
            return dict(condition)
    return {}


def pod_cause(pod: Mapping[str, Any], role: str) -> str:
    """Why the pod's engine ``role`` cannot run, in one line naming the pod, or "".

    Lines for what leaves no log of the engine's own (scheduling, image pulls, a lost node)
    hold ``error:``, so the command layer takes them as the cause (agents/commands.py,
    ``engine_cause``); a crash loop's line does not, so the engine's own last error stays the
    cause and this line, naming the pod, follows it in the event's tail."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name = meta.get("name", "?")
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        cpus, memory, devices = pod_requests(pod)
        asked = ", ".join([f"{cpus:g} CPUs", quantity(memory), *devices])
        return (
            f"pod {name} cannot be scheduled (scheduler error: "
            f"{_flat(scheduled.get('message') or 'Unschedulable')}); it requests {asked}"
        )
    if status.get("reason") in ("NodeLost", "NodeAffinity", "Evicted", "UnexpectedAdmissionError"):
        return (
            f"pod {name} was stopped by its node ({status['reason']} error: "
            f"{_flat(status.get('message') or status['reason'])})"
        )
    if status.get("phase") == "Unknown":
        node = (pod.get("spec") or {}).get("nodeName", "?")
        return (
            f"pod {name}: its node {node} is lost (NodeLost error: its kubelet stopped reporting)"
        )
    container = _container_status(pod, role)
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = str(waiting.get("reason") or "")
    message = _flat(str(waiting.get("message") or reason))
    if reason in PULL_FAILURES:
        image = container.get("image") or "?"
        return (
            f"pod {name} container {role}: image {image} cannot be pulled "
            f"({reason} error: {message})"
        )
    if reason in CONFIG_FAILURES:
        return f"pod {name} container {role} cannot be created ({reason} error: {message})"
    if reason == "CrashLoopBackOff":
        last = ((container.get("lastState") or {}).get("terminated") or {}).get("exitCode")
        return (
            f"pod {name} container {role} is in CrashLoopBackOff after "
            f"{container.get('restartCount', 0)} restarts (last exit code {last})"
        )
    return ""


def _flat(text: str) -> str:
    return " ".join(str(text).split())


def _status_of(pod: Mapping[str, Any], role: str) -> tuple[str, int | None]:
    """The agent's status of engine ``role`` (created | running | exited) and its exit code."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    container = _container_status(pod, role)
    state = container.get("state") or {}
    terminated = state.get("terminated") or {}
    code = terminated.get("exitCode")
    if pod_cause(pod, role) and "CrashLoopBackOff" not in pod_cause(pod, role):
        return "exited", code
    if "CrashLoopBackOff" in pod_cause(pod, role):
        last = ((container.get("lastState") or {}).get("terminated") or {}).get("exitCode")
        return "exited", last
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return "exited", code
    if "running" in state:
        return "running", None
    if terminated:
        return "exited", code
    return "created", None


def engine_state(pod: Mapping[str, Any], engine: PodEngine) -> EngineState:
    status, code = _status_of(pod, engine.role)
    container = _container_status(pod, engine.role)
    last = ((container.get("lastState") or {}).get("terminated") or {}).get("exitCode")
    name = str((pod.get("metadata") or {}).get("name", ""))
    return EngineState(
        engine_id=f"{name}/{engine.role}",
        name=engine.name,
        labels=dict(engine.labels),
        status=status,
        exit_code=code if status == "exited" else None,
        restarts=int(container.get("restartCount") or 0),
        endpoint=_endpoint(engine.spec),
        extra={
            "pod": name,
            "phase": (pod.get("status") or {}).get("phase"),
            "cause": pod_cause(pod, engine.role) or None,
            "last_exit_code": code if code is not None else last,
        },
    )


def _endpoint(spec: EngineSpec) -> str | None:
    try:
        return http_url(spec.host, spec.port) if spec.port else None
    except HostError:
        return None


def _grace(pod: Mapping[str, Any]) -> float:
    return float((pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 30)


def _api_message(exc: Exception) -> str:
    """The API server's own message (its Status body), else the client's words."""
    body = getattr(exc, "body", None)
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    return _flat(str(message or getattr(exc, "reason", None) or exc))


__all__ = [
    "KubernetesRuntime",
    "NodeCapacity",
    "PodEngine",
    "PodOptions",
    "engine_pod",
    "pod_cause",
    "pod_name",
]
