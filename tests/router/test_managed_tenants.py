"""A managed router's tenants (docs/router.md, "Tenants"): pulled with If-None-Match like the
policies, an invalid document kept out, the last good copy served across a restart with the
control plane down, and usage deltas kept until the control plane accepts them. Against an
in-process stand-in of the control plane; the client's sync is driven step by step."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from common.policy_schema import PolicyKnobs
from common.tenants import TenantRecord, hash_key
from router.client.errors import RouterError
from router.policy.managed import ControlPlaneClient
from router.state import Router, ServerConfig

ACME_KEY = "sk-shx-acme-key"
OTHER_KEY = "sk-shx-other-key"
ACME = TenantRecord("acme", frozenset({hash_key(ACME_KEY)}), rpm_limit=60)
OTHER = TenantRecord("other", frozenset({hash_key(OTHER_KEY)}))
ROUTER_ID = 7


class StandIn:
    """The control plane's router-facing API: register, deployments, the default policy,
    ``routing/tenants`` with ETags, stats and usage (whose answer a test sets)."""

    def __init__(self) -> None:
        self.tenants: dict[str, Any] | None = {"tenants": [ACME.as_document()]}
        self.version = 1
        self.tenant_answers: list[int] = []
        self.usage_status = 200
        self.usage_posts: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_post("/api/v1/routers/register", self.register)
        app.router.add_get("/api/v1/routing/deployments", self.deployments)
        app.router.add_get("/api/v1/routing/policies/default", self.policy)
        app.router.add_get("/api/v1/routing/tenants", self.routing_tenants)
        app.router.add_post(f"/api/v1/routers/{ROUTER_ID}/stats", self.stats)
        app.router.add_post(f"/api/v1/routers/{ROUTER_ID}/usage", self.usage)
        self.server = TestServer(app)

    def set_tenants(self, document: dict[str, Any] | None) -> None:
        self.tenants = document
        self.version += 1

    async def register(self, _: web.Request) -> web.Response:
        return web.json_response({"id": ROUTER_ID, "name": "r"}, status=201)

    async def deployments(self, _: web.Request) -> web.Response:
        return web.json_response({"deployments": []})

    async def policy(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"name": "default", "version": 1, "knobs": PolicyKnobs().as_dict()}
        )

    async def routing_tenants(self, http: web.Request) -> web.Response:
        if self.tenants is None:  # a control plane from before tenants
            self.tenant_answers.append(404)
            return web.json_response({"detail": "Not found."}, status=404)
        etag = f'"tenants-{self.version}"'
        if http.headers.get("If-None-Match") == etag:
            self.tenant_answers.append(304)
            return web.Response(status=304, headers={"ETag": etag})
        self.tenant_answers.append(200)
        return web.json_response(self.tenants, headers={"ETag": etag})

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def usage(self, http: web.Request) -> web.Response:
        body = await http.json()
        if self.usage_status >= 300:
            return web.json_response({"detail": "down"}, status=self.usage_status)
        self.usage_posts.append(body)
        return web.json_response({}, status=202)


Scenario = Callable[[StandIn, Callable[[], ControlPlaneClient]], Awaitable[None]]


def run(state_dir: Path, scenario: Scenario) -> None:
    """Run ``scenario`` with the stand-in listening and a factory of managed clients (a new
    router each call: a restart) that share ``state_dir``."""

    async def main() -> None:
        cp = StandIn()
        await cp.server.start_server()
        base_url = str(cp.server.make_url("/"))
        clients: list[ControlPlaneClient] = []

        def client() -> ControlPlaneClient:
            router = Router(ServerConfig(api_key="sxk_router"))
            made = ControlPlaneClient(
                router,
                base_url=base_url,
                token="sxr_t",
                name="r",
                state_dir=state_dir,
                stats_interval=0.0,
            )
            made.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            clients.append(made)
            return made

        try:
            await scenario(cp, client)
        finally:
            for made in clients:
                assert made.session is not None
                await made.session.close()
                await made.router.state.close()
            await cp.server.close()

    asyncio.run(main())


def tenant_of(client: ControlPlaneClient, key: str) -> str:
    return client.router.tenants.authenticate(f"Bearer {key}").name


def revoked(client: ControlPlaneClient, key: str) -> bool:
    try:
        client.router.tenants.authenticate(f"Bearer {key}")
    except RouterError as err:
        return err.status == 401
    return False


def test_tenants_are_pulled_with_etags_and_a_revoked_key_stops_working(tmp_path: Path) -> None:
    async def scenario(cp: StandIn, make: Callable[[], ControlPlaneClient]) -> None:
        client = make()
        await client.sync_once()
        assert tenant_of(client, ACME_KEY) == "acme"
        await client.sync_once()
        assert cp.tenant_answers == [200, 304]  # an unchanged table costs a 304
        cp.set_tenants({"tenants": [OTHER.as_document()]})
        await client.sync_once()
        assert revoked(client, ACME_KEY)
        assert tenant_of(client, OTHER_KEY) == "other"
        assert tenant_of(client, "sxk_router") == "router-key"

    run(tmp_path, scenario)


def test_an_invalid_tenants_document_is_never_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(cp: StandIn, make: Callable[[], ControlPlaneClient]) -> None:
        client = make()
        await client.sync_once()
        bad = dict(OTHER.as_document(), rpm_limit=-1)
        cp.set_tenants({"tenants": [bad]})
        with caplog.at_level(logging.ERROR, "syshax.router"):
            await client.sync_once()
            await client.sync_once()
        assert "tenants[0].rpm_limit" in caplog.text
        assert caplog.text.count("rejected invalid tenants document") == 1  # once per ETag
        assert tenant_of(client, ACME_KEY) == "acme" and revoked(client, OTHER_KEY)
        cached = json.loads((tmp_path / "router-state.json").read_text())
        assert [t["name"] for t in cached["tenants"]] == ["acme"]

    run(tmp_path, scenario)


def test_a_control_plane_without_tenants_leaves_the_router_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(cp: StandIn, make: Callable[[], ControlPlaneClient]) -> None:
        cp.set_tenants(None)
        client = make()
        with caplog.at_level(logging.WARNING, "syshax.router"):
            await client.sync_once()
            await client.sync_once()
        assert caplog.text.count("serves no routing/tenants") == 1
        assert tenant_of(client, "sxk_router") == "router-key"
        assert revoked(client, ACME_KEY)

    run(tmp_path, scenario)


def test_a_router_restarted_with_the_control_plane_down_serves_the_cached_keys(
    tmp_path: Path,
) -> None:
    async def scenario(cp: StandIn, make: Callable[[], ControlPlaneClient]) -> None:
        await make().sync_once()
        await cp.server.close()  # the control plane goes down
        restarted = make()
        restarted.attach("http://127.0.0.1:7010")  # restores the state file
        assert tenant_of(restarted, ACME_KEY) == "acme"
        assert restarted.router.tenants.authenticate(f"Bearer {ACME_KEY}").rpm_limit == 60
        assert revoked(restarted, OTHER_KEY)
        with pytest.raises(aiohttp.ClientError):
            await restarted.sync_once()
        assert tenant_of(restarted, ACME_KEY) == "acme"  # still, after a failed pull

    run(tmp_path, scenario)


def served(client: ControlPlaneClient, key: str, prompt: int, completion: int) -> None:
    tenants = client.router.tenants
    tenant = tenants.authenticate(f"Bearer {key}")
    tenants.settle(tenants.admit(tenant, "m", 10), prompt, completion, ok=True)


def test_usage_deltas_survive_a_failed_report_and_are_sent_once(tmp_path: Path) -> None:
    async def scenario(cp: StandIn, make: Callable[[], ControlPlaneClient]) -> None:
        client = make()
        await client.sync_once()
        assert cp.usage_posts == []  # nothing used, nothing sent
        served(client, ACME_KEY, 10, 20)
        client.router.tenants.reject(client.router.tenants.get("acme") or ACME, "shed")
        cp.usage_status = 503
        with pytest.raises(aiohttp.ClientResponseError):
            await client.sync_once()
        served(client, ACME_KEY, 1, 2)
        with pytest.raises(aiohttp.ClientResponseError):
            await client.sync_once()
        # Kept on disk meanwhile, for a restart.
        cached = json.loads((tmp_path / "router-state.json").read_text())
        assert cached["unsent_usage"]["acme"]["requests"] == 2
        cp.usage_status = 200
        await client.sync_once()
        await client.sync_once()
        assert cp.usage_posts == [
            {
                "tenants": {
                    "acme": {
                        "requests": 2,
                        "prompt_tokens": 11,
                        "completion_tokens": 22,
                        "rejected": {"shed": 1},
                    }
                }
            }
        ]
        cached = json.loads((tmp_path / "router-state.json").read_text())
        assert "unsent_usage" not in cached  # sent: a restart does not send it again

    run(tmp_path, scenario)


def test_usage_unsent_at_a_restart_is_sent_by_the_next_router(tmp_path: Path) -> None:
    async def scenario(cp: StandIn, make: Callable[[], ControlPlaneClient]) -> None:
        client = make()
        await client.sync_once()
        served(client, ACME_KEY, 3, 4)
        cp.usage_status = 500
        with pytest.raises(aiohttp.ClientResponseError):
            await client.sync_once()
        cp.usage_status = 200
        restarted = make()
        restarted.attach("http://127.0.0.1:7010")
        await restarted.sync_once()
        assert cp.usage_posts == [
            {
                "tenants": {
                    "acme": {
                        "requests": 1,
                        "prompt_tokens": 3,
                        "completion_tokens": 4,
                        "rejected": {},
                    }
                }
            }
        ]

    run(tmp_path, scenario)
