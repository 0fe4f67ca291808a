"""Stand-ins in the test process for what a managed router talks to: a control plane whose
deployment list a test edits, an engine that answers its metrics scrape but fails every
request (or stops listening: connections refused), and a silent host that accepts
connections and never answers.

Each runs in threads of its own, so the test drives the router with plain blocking calls.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from router_procs import MODEL, Proc

from common.policy_schema import PolicyKnobs

TOKEN = "sxr_standin"
# A vLLM engine's gauges, idle: the router sees the engine up and unloaded.
IDLE_METRICS = b"""\
vllm:num_requests_running{model_name="m"} 0.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:kv_cache_usage_perc{model_name="m"} 0.0
"""


def deployment(ident: int, name: str, gpu_url: str, cpu_url: str | None = None) -> dict[str, Any]:
    """One entry of ``routing/deployments``: a GPU (+ CPU) pair of ``MODEL`` on one node."""
    return {
        "id": ident,
        "name": name,
        "model": MODEL,
        "policy": "default",
        "pd_protocol": "vllm",
        "generation": 1,
        "state": "running",
        "gpu_url": gpu_url,
        "cpu_url": cpu_url,
    }


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _read_body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))


class _Threaded:
    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = _Server(("127.0.0.1", 0), handler)
        self.server.owner = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop listening: from now on connections to the URL are refused."""
        self.server.shutdown()
        self.server.server_close()


class StandInControlPlane(_Threaded):
    """``routers/register``, ``routing/deployments`` (with ETags) and the default policy."""

    def __init__(self, deployments: list[dict[str, Any]], **knobs: Any) -> None:
        self.lock = threading.Lock()
        self.deployments = deployments
        self.version = 1
        self.policy = {
            "name": "default",
            "version": 1,
            "knobs": dict(PolicyKnobs().as_dict(), **knobs),
        }
        super().__init__(_ControlPlaneHandler)

    def set_deployments(self, deployments: list[dict[str, Any]]) -> None:
        with self.lock:
            self.deployments = deployments
            self.version += 1

    def start_router(self, workdir: Path, name: str, *extra: str) -> Proc:
        return Proc(
            name,
            [
                "router",
                "--control-plane",
                self.url,
                "--token",
                TOKEN,
                "--name",
                name,
                "--state-dir",
                str(workdir / f"{name}-state"),
                "--poll-interval",
                "0.1",
                "--log-level",
                "INFO",
                *extra,
            ],
            workdir,
        )


class _ControlPlaneHandler(_Quiet):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        cp: StandInControlPlane = self.server.owner  # type: ignore[attr-defined]
        if self.path == "/api/v1/routing/deployments":
            with cp.lock:
                etag = f'"deployments-{cp.version}"'
                body = json.dumps({"deployments": cp.deployments}).encode()
            if self.headers.get("If-None-Match") == etag:
                self.send_response(304)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("ETag", etag)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/api/v1/routing/policies/default":
            self._send(200, json.dumps(cp.policy).encode())
        else:
            self._send(404, b'{"detail": "not found"}')

    def do_POST(self) -> None:
        self._read_body()
        if self.path == "/api/v1/routers/register":
            self._send(201, b'{"id": 1, "name": "router"}')
        else:
            self._send(200, b"{}")


class FailingEngine(_Threaded):
    """Answers its metrics scrape (idle) and every completion with HTTP 500; ``close()``
    makes it refuse connections instead."""

    def __init__(self) -> None:
        self.posts = 0
        super().__init__(_FailingHandler)


class _FailingHandler(_Quiet):
    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(200, IDLE_METRICS, "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        self._read_body()
        self.server.owner.posts += 1  # type: ignore[attr-defined]
        body = {"error": {"message": "engine failed", "type": "server_error", "code": 500}}
        self._send(500, json.dumps(body).encode())


class SilentHost:
    """A host that went quiet: the kernel accepts connections, nothing ever answers.

    Counts the connections still open (the router's end closes them) and the requests seen."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.open = 0
        self.requests: list[bytes] = []
        self.running = True
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.open += 1
                self.conns.append(conn)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        first = True
        try:
            while data := conn.recv(65536):
                if first:
                    with self.lock:
                        self.requests.append(data.split(b"\r\n", 1)[0])
                    first = False
        except OSError:
            pass
        with self.lock:
            self.open -= 1

    def completions_seen(self) -> int:
        with self.lock:
            return sum(1 for line in self.requests if line.startswith(b"POST "))

    def close(self) -> None:
        self.running = False
        self.sock.close()
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv
                conn.close()
            except OSError:
                pass


class PrefillOnlyEngine(_Threaded):
    """A GPU engine that prefills, keeps the prompt's KV (its connector found no room: a
    ``syshax_kv_fallback``) and so is asked to decode too, then fails that decode with HTTP
    500, as an engine does that dies between the two. Answers its metrics scrape (idle)."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        super().__init__(_PrefillOnlyHandler)


class _PrefillOnlyHandler(_FailingHandler):
    def do_POST(self) -> None:
        body = json.loads(self._read_body())
        self.server.owner.posts.append(body)  # type: ignore[attr-defined]
        if body.get("stream"):
            failed = {"error": {"message": "engine died", "type": "server_error", "code": 500}}
            self._send(500, json.dumps(failed).encode())
            return
        prompt_ids = list(range(1000, 1012))
        answer = {
            "id": "cmpl-prefill",
            "object": "text_completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "text": " first",
                    "token_ids": [1100],
                    "prompt_token_ids": prompt_ids,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 1},
            "kv_transfer_params": {"syshax_kv_fallback": "no free KV blocks for the handoff"},
        }
        self._send(200, json.dumps(answer).encode())
