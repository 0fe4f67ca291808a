"""The Batch API's fixtures: tenants with keys, an ``openai`` client per caller, a fake
router on loopback that records what the batch worker sends it, and the worker run inline."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

from controlplane.access.models import MachineCredential
from controlplane.batches.models import BatchFile
from controlplane.tenants.models import Tenant
from controlplane.tenants.services import issue_key


@dataclass
class FakeRouter:
    """Answers /v1/chat/completions and /v1/completions like a router. A request whose
    prompt names a behaviour gets it: ``fail`` a 400, ``busy`` one 429 first (Retry-After 0),
    ``crash`` a 500."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    busy_seen: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Called with each request before it is answered (a test may raise in it, or wait).
    on_request: Callable[[dict[str, Any]], None] | None = None

    def answer(self, path: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        prompt = json.dumps(body.get("messages") or body.get("prompt"))
        with self.lock:
            self.requests.append({"path": path, "headers": headers, "body": body})
        if self.on_request is not None:
            self.on_request(body)
        if "busy" in prompt:
            with self.lock:
                first = prompt not in self.busy_seen
                self.busy_seen.add(prompt)
            if first:
                return 429, {"error": {"message": "saturated", "code": "saturated"}}
        if "fail" in prompt:
            return 400, {
                "error": {
                    "message": "bad prompt",
                    "type": "invalid_request_error",
                    "code": "invalid_value",
                    "param": "messages",
                }
            }
        if "crash" in prompt:
            return 500, {"error": {"message": "engine fell over", "code": "internal_error"}}
        text = f"echo {prompt}"
        if path.endswith("/chat/completions"):
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
            return 200, {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [choice],
            }
        return 200, {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
        }

    def sent(self) -> list[str]:
        """custom_ids are not sent; each request's prompt names its line."""
        with self.lock:
            return [json.dumps(r["body"].get("messages")) for r in self.requests]


@pytest.fixture
def fake_router() -> Iterator[FakeRouter]:
    router = FakeRouter()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            status, answer = router.answer(self.path, dict(self.headers), body)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 429:
                self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    router.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield router
    server.shutdown()
    server.server_close()


@pytest.fixture
def batch_settings(settings: Any, fake_router: FakeRouter) -> Any:
    settings.BATCH_ROUTER_URL = fake_router.url
    settings.ROUTER_API_KEY = "router-secret"
    settings.BATCH_CONCURRENCY = 3
    settings.BATCH_MAX_ATTEMPTS = 3
    return settings


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The batch ids the services queue, instead of queueing them: tests run the worker."""
    ids: list[str] = []
    monkeypatch.setattr(
        "controlplane.batches.services.enqueue", lambda name, *args: ids.append(args[0])
    )
    return ids


def make_tenant(name: str, **fields: Any) -> tuple[Tenant, str]:
    tenant = Tenant.objects.create(name=name, **fields)
    _, key = issue_key(tenant, acting_user=None)
    return tenant, key


@pytest.fixture
def acme(transactional_db: Any) -> tuple[Tenant, str]:
    return make_tenant("acme", models=["tiny", "small"])


@pytest.fixture
def globex(transactional_db: Any) -> tuple[Tenant, str]:
    return make_tenant("globex")


@pytest.fixture
def client_for(
    live_server: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., openai.OpenAI]]:
    # The client names the platform in its headers, which asks `uname -p` (a child process).
    monkeypatch.setattr("openai._base_client.get_platform", lambda: "Linux")
    made: list[openai.OpenAI] = []

    def make(key: str, **headers: str) -> openai.OpenAI:
        client = openai.OpenAI(
            api_key=key,
            base_url=f"{live_server.url}/v1",
            max_retries=0,
            default_headers=headers or None,
        )
        made.append(client)
        return client

    yield make
    # A kept-alive connection holds the live server's thread, and its database connection.
    for client in made:
        client.close()


@pytest.fixture
def router_token(transactional_db: Any) -> str:
    _, token = MachineCredential.issue("router", "router-a")
    return token


def line(custom_id: str, content: str, *, model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": content}]},
        **extra,
    }


def jsonl(*records: Any) -> bytes:
    return b"".join(
        (r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records
    )


def file_bytes(file: BatchFile | None) -> bytes:
    """A stored file's bytes, its chunks joined."""
    assert file is not None
    return b"".join(file.iter_bytes())
