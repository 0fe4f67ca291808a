"""A stand-in for the Kubernetes API server, for the agent's Kubernetes runtime.

NOT Kubernetes: no scheduler, no kubelet, no admission. It is an HTTP server on 127.0.0.1 that
speaks the subset of the core/v1 REST API the runtime's client uses (create, get, list with an
equality label selector, delete pods; read a container's log), answers failures with the API's
``Status`` objects (404 NotFound, 409 AlreadyExists, 403 Forbidden in the API server's words),
and leaves every status change to the test, which drives the pods through the states the
Kubernetes documentation describes (pod phases, container states, the ``PodScheduled``
condition, a graceful deletion's ``deletionTimestamp``). The real ``kubernetes`` client talks
to it through a ``Configuration`` whose host is this server.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

SERVICE_ACCOUNT = "system:serviceaccount:syshax:syshax-agent"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, reason: str, message: str, name: str = "") -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {"name": name, "kind": "pods"},
        "code": code,
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    """An equality-based label selector: ``a=b,c!=d,e`` (the forms the API documents)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


class StandInKubernetesAPI:
    def __init__(self, *, node: str = "gpu-node-1") -> None:
        self.node = node
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.logs: dict[tuple[str, str], str] = {}  # (pod, container) -> its current log
        self.previous_logs: dict[tuple[str, str], str] = {}
        self.forbidden: set[tuple[str, str]] = set()  # (verb, resource) the account may not
        self.graceful = False  # deletions leave the pod terminating until finish_deletion()
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict[str, Any]] = []  # every pod body as the client sent it
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------ server

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
                raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _route(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                with outer.lock:
                    outer.requests.append((method, self.path))
                    status, answer, kind = outer.handle(method, url.path, query, body)
                self._send(status, answer, kind)

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ------------------------------------------------------------ the REST subset

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any
    ) -> tuple[int, Any, str]:
        parts = path.strip("/").split("/")
        # /api/v1/namespaces/{ns}/pods[/{name}[/log]]
        if parts[:3] != ["api", "v1", "namespaces"] or len(parts) < 5 or parts[4] != "pods":
            return (
                404,
                _status(404, "NotFound", f"the server could not find {path}"),
                "application/json",
            )
        namespace = parts[3]
        name = parts[5] if len(parts) > 5 else ""
        sub = parts[6] if len(parts) > 6 else ""
        verb = {"POST": "create", "DELETE": "delete"}.get(method, "get" if name else "list")
        resource = "pods/log" if sub == "log" else "pods"
        if (verb, resource) in self.forbidden:
            target = f'pods "{name}"' if name else "pods"
            message = (
                f'{target} is forbidden: User "{SERVICE_ACCOUNT}" cannot {verb} resource '
                f'"{resource}" in API group "" in the namespace "{namespace}"'
            )
            return 403, _status(403, "Forbidden", message, name), "application/json"
        if method == "POST" and not name:
            return self._create(namespace, body)
        if method == "GET" and not name:
            items = [
                copy.deepcopy(p)
                for (ns, _), p in sorted(self.pods.items())
                if ns == namespace
                and _matches(p["metadata"].get("labels") or {}, query.get("labelSelector", ""))
            ]
            answer = {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
            return 200, answer, "application/json"
        pod = self.pods.get((namespace, name))
        if pod is None:
            return (
                404,
                _status(404, "NotFound", f'pods "{name}" not found', name),
                "application/json",
            )
        if method == "GET" and sub == "log":
            return self._log(pod, query)
        if method == "GET":
            return 200, copy.deepcopy(pod), "application/json"
        if method == "DELETE":
            grace = query.get("gracePeriodSeconds") or (body or {}).get("gracePeriodSeconds")
            if self.graceful and grace not in (None, 0, "0"):
                pod["metadata"].setdefault("deletionTimestamp", _now())
                pod["metadata"]["deletionGracePeriodSeconds"] = int(grace)
            else:
                del self.pods[(namespace, name)]
            return 200, copy.deepcopy(pod), "application/json"
        return 405, _status(405, "MethodNotAllowed", method), "application/json"

    def _create(self, namespace: str, body: dict[str, Any]) -> tuple[int, Any, str]:
        self.created.append(copy.deepcopy(body))
        name = body["metadata"]["name"]
        if (namespace, name) in self.pods:
            message = f'pods "{name}" already exists'
            return 409, _status(409, "AlreadyExists", message, name), "application/json"
        pod = copy.deepcopy(body)
        pod["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
        pod["status"] = {"phase": "Pending", "qosClass": "Guaranteed"}
        self.pods[(namespace, name)] = pod
        return 201, copy.deepcopy(pod), "application/json"

    def _log(self, pod: dict[str, Any], query: dict[str, str]) -> tuple[int, Any, str]:
        name = pod["metadata"]["name"]
        container = query.get("container", "")
        statuses = {
            s["name"]: s
            for s in (pod["status"].get("initContainerStatuses") or [])
            + (pod["status"].get("containerStatuses") or [])
        }
        state = statuses.get(container, {}).get("state", {})
        previous = query.get("previous") in ("true", "True")
        if previous:
            text = self.previous_logs.get((name, container))
            if text is None:
                message = f'previous terminated container "{container}" in pod "{name}" not found'
                return 400, _status(400, "BadRequest", message, name), "application/json"
        elif "waiting" in state or not state:
            reason = state.get("waiting", {}).get("reason", "ContainerCreating")
            message = f'container "{container}" in pod "{name}" is waiting to start: {reason}'
            return 400, _status(400, "BadRequest", message, name), "application/json"
        else:
            text = self.logs.get((name, container), "")
        lines = text.splitlines()
        tail = int(query.get("tailLines") or len(lines) or 1)
        return 200, "\n".join(lines[-tail:]) + ("\n" if lines else ""), "text/plain"

    # ------------------------------------------------------------ what the test drives

    def pod(self, name: str) -> dict[str, Any]:
        (found,) = [p for (_, n), p in self.pods.items() if n == name]
        return found

    def _containers(self, pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        for field, key in (
            ("initContainers", "initContainerStatuses"),
            ("containers", "containerStatuses"),
        ):
            for container in pod["spec"].get(field) or []:
                yield key, container

    def _set(self, name: str, phase: str, states: dict[str, dict[str, Any]], **more: Any) -> None:
        with self.lock:
            pod = self.pod(name)
            old = {
                s["name"]: s
                for key in ("initContainerStatuses", "containerStatuses")
                for s in pod["status"].get(key) or []
            }
            status: dict[str, Any] = {"phase": phase, "qosClass": "Guaranteed", **more}
            status["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            pod["spec"]["nodeName"] = self.node
            for key, container in self._containers(pod):
                before = old.get(container["name"], {})
                state = states.get(
                    container["name"],
                    before.get("state") or {"waiting": {"reason": "PodInitializing"}},
                )
                entry = {
                    "name": container["name"],
                    "image": container["image"],
                    "ready": "running" in state,
                    "restartCount": before.get("restartCount", 0),
                    "state": state,
                    "lastState": before.get("lastState", {}),
                }
                status.setdefault(key, []).append(entry)
            pod["status"] = status

    def run(self, name: str) -> None:
        """Scheduled, every container started: phase Running."""
        pod = self.pod(name)
        started = {"running": {"startedAt": _now()}}
        self._set(name, "Running", {c["name"]: started for _, c in self._containers(pod)})

    def unschedulable(self, name: str, message: str) -> None:
        with self.lock:
            pod = self.pod(name)
            pod["status"] = {
                "phase": "Pending",
                "qosClass": "Guaranteed",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": message,
                    }
                ],
            }

    def image_pull_fails(self, name: str, container: str, reason: str = "ImagePullBackOff") -> None:
        image = next(
            c["image"] for _, c in self._containers(self.pod(name)) if c["name"] == container
        )
        message = f'Back-off pulling image "{image}": not found'
        self._set(name, "Pending", {container: {"waiting": {"reason": reason, "message": message}}})

    def crash_loop(
        self, name: str, container: str, *, exit_code: int, restarts: int, log: str
    ) -> None:
        self.previous_logs[(name, container)] = log
        self._set(
            name,
            "Running",
            {container: {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}}},
        )
        with self.lock:
            for status in self._all_statuses(self.pod(name)):
                if status["name"] == container:
                    status["restartCount"] = restarts
                    status["lastState"] = {"terminated": {"exitCode": exit_code, "reason": "Error"}}

    def exit(self, name: str, container: str, exit_code: int, log: str = "") -> None:
        """The container ended and the pod with it (restartPolicy Never): phase Failed."""
        self.logs[(name, container)] = log
        terminated = {"terminated": {"exitCode": exit_code, "reason": "Error"}}
        self._set(name, "Failed" if exit_code else "Succeeded", {container: terminated})

    def node_lost(self, name: str) -> None:
        """The node stopped reporting: the pod's phase is Unknown, its reason NodeLost."""
        with self.lock:
            pod = self.pod(name)
            pod["status"]["phase"] = "Unknown"
            pod["status"]["reason"] = "NodeLost"
            pod["status"]["message"] = (
                f"Node {self.node} which was running pod {name} is unresponsive"
            )

    def finish_deletion(self, name: str) -> None:
        with self.lock:
            for key, pod in list(self.pods.items()):
                if key[1] == name and pod["metadata"].get("deletionTimestamp"):
                    del self.pods[key]

    def _all_statuses(self, pod: dict[str, Any]) -> list[dict[str, Any]]:
        status = pod["status"]
        return list(status.get("initContainerStatuses") or []) + list(
            status.get("containerStatuses") or []
        )

    @contextmanager
    def forbid(self, verb: str, resource: str = "pods") -> Iterator[None]:
        self.forbidden.add((verb, resource))
        try:
            yield
        finally:
            with suppress(KeyError):
                self.forbidden.remove((verb, resource))
