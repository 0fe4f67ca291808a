"""A stand-in for the control plane's agent endpoints, for the agent's pure client behaviour.

NOT the control plane: it only records what the agent sends and answers in the shapes of
docs/machine-api.md, so back-off, outage and reconcile behaviour can be pinned without Django.
The end-to-end tests against the real control plane are in test_agent_e2e.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandInControlPlane:
    def __init__(
        self,
        *,
        node_name: str,
        broker_url: str,
        port: int = 0,
        interval: float = 0.2,
        broker_options: dict[str, Any] | None = None,
    ) -> None:
        self.node_name = node_name
        self.broker_url = broker_url
        self.broker_options = broker_options or {}
        self.interval = interval
        self.requests: list[tuple[str, str, Any]] = []
        self.force_hash_mismatch = 0  # answer this many heartbeats with a foreign hash
        self.inventory_hash = ""
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = port

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, body: dict[str, Any], status: int = 200) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.removeprefix("/api/v1/")
                if self.headers.get("Authorization") != "Bearer sxa_test":
                    self._answer({"error": {"code": "not_authenticated", "message": "no"}}, 401)
                    return
                with outer.lock:
                    outer.requests.append((self.command, path, body))
                    self._answer(outer.route(self.command, path, body))

            do_GET = do_PUT = do_POST = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def route(self, method: str, path: str, body: Any) -> dict[str, Any]:
        if path == "agent/self":
            return {
                "node": {"id": 5, "name": self.node_name},
                "heartbeat_interval_seconds": self.interval,
                "command_queue": f"node.{self.node_name}",
                "broker_url": self.broker_url,
                "broker_transport_options": self.broker_options,
            }
        if path == "nodes/5/inventory":
            self.inventory_hash = _hash(body)
            return {"changed": True, "inventory_hash": self.inventory_hash}
        if path == "nodes/5/heartbeat":
            answer = body["inventory_hash"]
            if self.force_hash_mismatch:
                self.force_hash_mismatch -= 1
                answer = "sha256:stale"
            return {
                "status": "online",
                "inventory_hash": answer,
                "heartbeat_interval_seconds": self.interval,
            }
        if path.startswith("commands/"):
            return {"accepted": True}
        if path == "nodes/5/containers":
            return {"updated": len(body["containers"])}
        return {"error": {"code": "not_found", "message": path}}

    def seen(self, method: str, path: str) -> list[Any]:
        with self.lock:
            return [body for m, p, body in self.requests if m == method and p == path]


def _hash(body: Any) -> str:
    from agents.discovery import inventory_hash

    return inventory_hash(body)
