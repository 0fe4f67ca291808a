"""Router keys, the benchmark key and prompts go only to the routers the operator configured
(ROUTER_URLS), never to an address a router only reported
(docs/decisions/0056-router-destinations-configured.md)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from common.hosts import HostError, check_origin
from controlplane.access.models import MachineCredential
from controlplane.batches import runner as batch_runner
from controlplane.batches import services as batch_services
from controlplane.batches.auth import Caller
from controlplane.benchmarks import runner as bench_runner
from controlplane.benchmarks.models import BenchmarkRun, Scenario
from controlplane.benchmarks.services import check_target
from controlplane.routers.api.serializers import RouterInstanceSerializer
from controlplane.routers.models import RouterInstance
from controlplane.settings.base import _router_origins
from controlplane.settings.env import ImproperlyConfiguredEnv
from controlplane.tenants.models import Tenant


@dataclass
class Listener:
    """Anything listening on loopback: records every request it gets, answers a chat."""

    url: str = ""
    seen: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def listener() -> Iterator[Listener]:
    found = Listener()

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            found.seen.append({"path": self.path, "headers": dict(self.headers), "body": body})
            data = json.dumps({"choices": [{"index": 0, "message": {"content": "ok"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _record

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    found.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield found
    server.shutdown()
    server.server_close()


@pytest.fixture
def reported(db: Any, listener: Listener, settings: Any) -> RouterInstance:
    """A live registered router whose reported listen_url is the listener; nothing configured."""
    settings.ROUTER_URLS = []
    settings.BATCH_ROUTER_URL = ""
    settings.ROUTER_API_KEY = "sxk_router_secret"
    settings.ROUTER_BENCHMARK_KEY = "sxk_bench_secret"
    settings.BENCHMARK_ALLOWED_TARGETS = []
    credential, _ = MachineCredential.issue("router", "thief")
    return RouterInstance.objects.create(
        name="thief", credential=credential, listen_url=listener.url, last_seen_at=timezone.now()
    )


def make_batch() -> Any:
    tenant = Tenant.objects.create(name="acme")
    caller = Caller("acme", tenant)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "secret prompt"}]},
    }
    content = (json.dumps(line) + "\n").encode()
    source = batch_services.create_file(
        caller, filename="in.jsonl", purpose="batch", size=len(content), pieces=[content]
    )
    return batch_services.create_batch(
        caller, input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


@pytest.fixture
def no_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("controlplane.batches.services.enqueue", lambda *args: None)


def test_the_batch_worker_sends_nothing_to_a_reported_address(
    reported, listener, no_queue, settings
) -> None:
    batch = make_batch()
    assert batch_runner.router_url() is None
    assert batch_runner.execute(batch.id) == "waiting for a router"
    assert listener.seen == []

    settings.ROUTER_URLS = [listener.url]  # the operator names it: now it gets the lines
    assert batch_runner.router_url() == listener.url
    assert batch_runner.execute(batch.id) == "completed"
    [sent] = listener.seen
    assert sent["path"] == "/v1/chat/completions" and b"secret prompt" in sent["body"]
    assert sent["headers"]["Authorization"] == "Bearer sxk_router_secret"


def test_the_batch_worker_prefers_a_configured_router_that_is_alive(db, settings) -> None:
    settings.BATCH_ROUTER_URL = ""
    settings.ROUTER_URLS = ["http://127.0.0.1:9", "http://127.0.0.1:7010"]
    assert batch_runner.router_url() == "http://127.0.0.1:9"  # none alive: the first
    credential, _ = MachineCredential.issue("router", "r")
    RouterInstance.objects.create(
        name="r",
        credential=credential,
        listen_url="http://localhost:7010/",
        last_seen_at=timezone.now(),
    )
    assert batch_runner.router_url() == "http://127.0.0.1:7010"


def test_a_benchmark_sends_no_key_or_load_to_a_reported_address(
    reported, listener, make_deployment, settings
) -> None:
    with pytest.raises(ValidationError, match="configured router"):
        check_target(listener.url)
    assert bench_runner.router_api_key(listener.url) == ""
    d = make_deployment(state="running")
    scenario = Scenario.objects.create(name="tiny", input_tokens=8, output_tokens=4)
    run = BenchmarkRun.objects.create(
        scenario=scenario, deployment=d, mode="gpu", concurrency=[1], iterations=1
    )
    with pytest.raises(bench_runner.RunError, match="ROUTER_URLS"):
        bench_runner.target_url(run)
    assert listener.seen == []

    settings.ROUTER_URLS = [listener.url]
    check_target(listener.url)
    assert bench_runner.target_url(run) == listener.url
    assert bench_runner.router_api_key(listener.url + "/") == "sxk_bench_secret"
    settings.ROUTER_BENCHMARK_KEY = ""
    assert bench_runner.router_api_key(listener.url) == "sxk_router_secret"


def test_a_reported_address_is_shown_as_not_configured(reported, listener, settings) -> None:
    assert RouterInstanceSerializer(reported).data["listen_url_configured"] is False
    settings.ROUTER_URLS = [listener.url]
    assert RouterInstanceSerializer(reported).data["listen_url_configured"] is True


@pytest.mark.parametrize(
    "url",
    ["http://a/path", "ftp://a:1", "http://u@a:1", "http://a:1?q", "http://10.0.0.5:22#", "x"],
)
def test_router_urls_are_plain_origins_or_start_fails_naming_the_variable(url: str) -> None:
    with pytest.raises(HostError):
        check_origin(url)
    with pytest.raises(ImproperlyConfiguredEnv, match="ROUTER_URLS"):
        _router_origins("ROUTER_URLS", ["http://127.0.0.1:7010", url])
    assert _router_origins("ROUTER_URLS", ["HTTP://Router:7010/", "http://router:7010"]) == [
        "http://router:7010"
    ]
