"""The playground (docs/dashboard.md): one chat through a configured router, forced to a mode, with
the route, the reason, TTFT and tokens/s the control plane measured; the router's own error
message when it refuses; the operator's permission and a CSRF token needed."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from common.supervisor import free_port
from controlplane.access.models import MachineCredential
from controlplane.routers.models import RouterInstance

KEY = "sxk_bench_playground"


class FakeRouter:
    """A router stand-in on loopback: a streamed chat with the route and reason headers, or
    an OpenAI error when the prompt says ``refuse``; it records what it was sent."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self.ready.set()
        self.loop.run_forever()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"headers": dict(request.headers), "body": body})
        if "refuse" in body["messages"][0]["content"]:
            return web.json_response(
                {
                    "error": {
                        "message": "all engines are saturated: gpu-queue",
                        "type": "rate_limit",
                        "code": "saturated",
                    }
                },
                status=429,
            )
        mode = request.headers.get("X-Syshax-Mode", "")
        route = {"gpu-only": "gpu-only", "forced-pd": "pd"}.get(mode, "pd")
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "X-Syshax-Route": route,
                "X-Syshax-Reason": "forced" if mode != "auto" else "short-prompt",
            }
        )
        await response.prepare(request)
        await asyncio.sleep(0.05)  # prefill
        words = ["Hello", " from", " the", " engines"]
        for word in words:
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(words)}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake_router(db: Any, settings) -> Iterator[FakeRouter]:
    settings.ROUTER_BENCHMARK_KEY = KEY
    fake = FakeRouter()
    settings.ROUTER_URLS = [fake.url]
    credential, _ = MachineCredential.issue("router", "router-play")
    RouterInstance.objects.create(
        name="router-play", credential=credential, listen_url=fake.url, last_seen_at=timezone.now()
    )
    yield fake
    fake.close()


def send(client: Client, pk: int, **fields: Any) -> Any:
    data = {"play-prompt": "hi", "play-max_tokens": "8", "play-mode": "auto", **fields}
    return client.post(
        reverse("dashboard:deployment-playground", args=[pk]), data, HTTP_ACCEPT="application/json"
    )


def test_a_chat_shows_route_reason_ttft_and_tokens_per_second(
    fake_router: FakeRouter, make_deployment, operator_client: Client
) -> None:
    d = make_deployment()
    page = operator_client.get(reverse("dashboard:deployment", args=[d.pk])).content.decode()
    assert "Playground" in page and "router-play" in page and 'name="play-prompt"' in page

    answer = send(operator_client, d.pk, **{"play-mode": "forced-pd", "play-prompt": "tell me"})
    assert answer.status_code == 200, answer.content
    result = answer.json()
    assert result["ok"] is True and result["error"] == ""
    assert (result["route"], result["reason"], result["router"]) == ("pd", "forced", "router-play")
    assert result["text"] == "Hello from the engines"
    assert result["completion_tokens"] == 4
    assert result["ttft_ms"] >= 40  # the stand-in's 50 ms prefill
    assert result["tokens_per_second"] > 0 and result["tpot_ms"] > 0
    seen = fake_router.seen[-1]
    assert seen["headers"]["X-Syshax-Mode"] == "forced-pd"
    assert seen["headers"]["Authorization"] == f"Bearer {KEY}"
    assert seen["body"]["model"] == d.profile.model_name_for_clients
    assert seen["body"]["max_tokens"] == 8 and seen["body"]["stream"] is True

    auto = send(operator_client, d.pk).json()
    assert (auto["route"], auto["reason"]) == ("pd", "short-prompt")
    gpu = send(operator_client, d.pk, **{"play-mode": "gpu-only"}).json()
    assert gpu["route"] == "gpu-only"


def test_the_routers_error_message_is_shown_without_a_trace(
    fake_router: FakeRouter, make_deployment, operator_client: Client
) -> None:
    d = make_deployment()
    answer = send(operator_client, d.pk, **{"play-prompt": "please refuse"})
    assert answer.status_code == 502
    result = answer.json()
    assert result["ok"] is False and result["status"] == 429
    assert result["error"] == "all engines are saturated: gpu-queue"
    assert "Traceback" not in answer.content.decode()


def test_bad_fields_and_no_router_are_answered_in_words(make_deployment, operator_client) -> None:
    d = make_deployment()
    bad = send(operator_client, d.pk, **{"play-max_tokens": "0", "play-mode": "turbo"})
    assert bad.status_code == 400
    assert set(bad.json()["errors"]) == {"max_tokens", "mode"}
    none = send(operator_client, d.pk)
    assert none.status_code == 502 and "no router configured" in none.json()["error"]


def test_a_router_that_is_gone_is_a_message(make_deployment, operator_client, db, settings) -> None:
    credential, _ = MachineCredential.issue("router", "router-gone")
    gone = f"http://127.0.0.1:{free_port()}"
    settings.ROUTER_URLS = [gone]
    RouterInstance.objects.create(
        name="router-gone", credential=credential, listen_url=gone, last_seen_at=timezone.now()
    )
    d = make_deployment()
    result = send(operator_client, d.pk).json()
    assert result["ok"] is False and result["error"].startswith("could not reach the router")


def test_without_the_script_the_answer_is_a_message(
    fake_router: FakeRouter, make_deployment, operator_client: Client
) -> None:
    d = make_deployment()
    url = reverse("dashboard:deployment-playground", args=[d.pk])
    data = {"play-prompt": "hi", "play-max_tokens": "8", "play-mode": "gpu-only"}
    page = operator_client.post(url, data, follow=True).content.decode()
    assert "route gpu-only (forced)" in page and "Hello from the engines" in page


def test_the_playground_needs_the_operators_permission_and_a_csrf_token(
    fake_router: FakeRouter, make_deployment, viewer_client: Client, operator: User
) -> None:
    d = make_deployment()
    page = viewer_client.get(reverse("dashboard:deployment", args=[d.pk])).content.decode()
    assert 'name="play-prompt"' not in page
    assert send(viewer_client, d.pk).status_code == 403
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(operator)
    assert send(strict, d.pk).status_code == 403
    assert fake_router.seen == []
    assert Client().get(reverse("dashboard:deployment-playground", args=[d.pk])).status_code in (
        302,
        405,
    )


def test_a_registered_router_that_is_not_configured_gets_nothing(
    make_deployment, operator_client: Client, db, settings
) -> None:
    """Any router token can register an address; the operator's prompt and the benchmark key
    go only to ROUTER_URLS (docs/decisions/0056-router-destinations-configured.md)."""
    settings.ROUTER_BENCHMARK_KEY = KEY
    settings.ROUTER_URLS = []
    listener = FakeRouter()
    try:
        credential, _ = MachineCredential.issue("router", "thief")
        RouterInstance.objects.create(
            name="thief",
            credential=credential,
            listen_url=listener.url,
            last_seen_at=timezone.now(),
        )
        d = make_deployment()
        page = operator_client.get(reverse("dashboard:deployment", args=[d.pk])).content.decode()
        assert "No router is configured" in page
        answer = send(operator_client, d.pk, **{"play-prompt": "operator secret"})
        assert answer.status_code == 502 and "ROUTER_URLS" in answer.json()["error"]
        assert listener.seen == []

        settings.ROUTER_URLS = [listener.url]  # the operator names it: now it answers
        result = send(operator_client, d.pk, **{"play-prompt": "operator secret"}).json()
        assert result["ok"] is True and result["router"] == "thief"
        [seen] = listener.seen
        assert seen["headers"]["Authorization"] == f"Bearer {KEY}"
    finally:
        listener.close()
