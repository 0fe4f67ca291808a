"""A stand-in for the control plane's agent endpoints, for the agent's pure client behaviour.

NOT the control plane: it only records what the agent sends and answers in the shapes of
docs/machine-api.md, so back-off, outage and reconcile behaviour can be pinned without Django.
The end-to-end tests against the real control plane are in test_agent_e2e.py.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class StandInControlPlane:
    def __init__(
        self, *, node_name: str, port: int = 0, interval: float = 0.2, wait: float = 0.5
    ) -> None:
        self.node_name = node_name
        self.interval = interval
        self.wait = wait  # the long poll of GET agent/commands
        self.requests: list[tuple[str, str, Any]] = []
        self.force_hash_mismatch = 0  # answer this many heartbeats with a foreign hash
        self.fail_results = False  # answer command results with 503 (the agent keeps them)
        self.inventory_hash = ""
        # Commands as the real control plane hands them out: each entry once per agent
        # session, until a result for its dispatch arrives.
        self.commands: list[tuple[dict[str, Any], set[str]]] = []
        self.answered: set[str] = set()
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = port

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def handle_one_request(self) -> None:
                with suppress(BrokenPipeError):  # an agent killed in its long poll
                    super().handle_one_request()

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
                url = urlsplit(self.path)
                path = url.path.removeprefix("/api/v1/")
                if self.headers.get("Authorization") != "Bearer sxa_test":
                    self._answer({"error": {"code": "not_authenticated", "message": "no"}}, 401)
                    return
                if path == "agent/commands":
                    session = parse_qs(url.query)["session"][0]
                    self._answer({"commands": outer.take(session)})
                    return
                if path.startswith("commands/") and outer.fail_results:
                    self._answer({"error": {"code": "unavailable", "message": "down"}}, 503)
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

    def enqueue(self, **message: Any) -> None:
        """Issue a command to the agent (again, for the same dispatch id: a redelivery)."""
        with self.lock:
            dispatch_id = str(message["dispatch_id"])
            self.answered.discard(dispatch_id)
            self.commands = [c for c in self.commands if c[0]["dispatch_id"] != dispatch_id]
            self.commands.append(({"node": self.node_name, **message}, set()))

    def take(self, session: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.wait
        while True:
            with self.lock:
                out = []
                for message, sessions in self.commands:
                    if session not in sessions and message["dispatch_id"] not in self.answered:
                        sessions.add(session)
                        out.append(message)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.05)

    def route(self, method: str, path: str, body: Any) -> dict[str, Any]:
        if path == "agent/self":
            return {
                "node": {"id": 5, "name": self.node_name},
                "heartbeat_interval_seconds": self.interval,
                "command_wait_seconds": self.wait,
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
            self.answered.add(path.split("/")[1])
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
