"""The official ``openai`` client's batch calls at a router's base URL: the router hands them
to the control plane as the caller's tenant, unchanged."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import openai
import pytest
from aiohttp import web

from common.supervisor import free_port
from common.tenants import TenantRecord, hash_key
from controlplane.batches import runner
from router.api.app import build_app
from router.state import ControlPlaneLink, Router, ServerConfig
from tests.controlplane.batches.conftest import jsonl, line


@pytest.fixture
def router_url(acme, router_token, live_server) -> Iterator[str]:
    """A router in this process (its own event loop thread) managed by the live server, with
    acme's key in its tenant table."""
    _, key = acme
    router = Router(ServerConfig(api_key="router-secret"))
    router.tenants.set_records([TenantRecord("acme", key_hashes=frozenset({hash_key(key)}))])
    router.control_plane = ControlPlaneLink(live_server.url, router_token)
    loop = asyncio.new_event_loop()
    port = free_port()
    app_runner = web.AppRunner(build_app(router))

    async def start() -> None:
        await app_runner.setup()
        await web.TCPSite(app_runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"http://127.0.0.1:{port}/v1"
    asyncio.run_coroutine_threadsafe(app_runner.cleanup(), loop).result(10)
    asyncio.run_coroutine_threadsafe(router.state.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_the_official_client_at_the_router(
    acme, router_url, batch_settings, fake_router, queued, monkeypatch
) -> None:
    monkeypatch.setattr("openai._base_client.get_platform", lambda: "Linux")
    with openai.OpenAI(api_key=acme[1], base_url=router_url, max_retries=0) as client:
        check_batch_calls(client, router_url)
    assert {r["headers"]["X-Syshax-Tenant"] for r in fake_router.requests} == {"acme"}


def check_batch_calls(client: openai.OpenAI, router_url: str) -> None:
    source = client.files.create(
        file=("in.jsonl", jsonl(line("a", "hi"), line("b", "fail"))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    runner.execute(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    assert done.output_file_id and done.error_file_id
    output = [json.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert [r["custom_id"] for r in output] == ["a"]
    assert [b.id for b in client.batches.list()] == [batch.id]
    with (
        openai.OpenAI(api_key="sk-shx-wrong", base_url=router_url, max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.files.list()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


def test_a_batch_through_the_router_is_the_tenants(acme, router_url, client_for, queued) -> None:
    # client_for also keeps the client from asking `uname -p` (a child process).
    with openai.OpenAI(api_key=acme[1], base_url=router_url, max_retries=0) as at_router:
        made = at_router.files.create(file=("in.jsonl", jsonl(line("a", "hi"))), purpose="batch")
    assert [f.id for f in client_for(acme[1]).files.list()] == [made.id]
