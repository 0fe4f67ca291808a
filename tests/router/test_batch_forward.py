"""The router hands the Batch API's paths to its control plane, as the caller's tenant."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.tenants import TenantRecord, hash_key
from router.api import batches
from router.api.app import build_app
from router.state import ControlPlaneLink, Router, ServerConfig

ACME_KEY = "sk-shx-acme-key"
ROUTER_API_KEY = "router-api-key"
TOKEN = "sxr_router-token"

Client = TestClient[web.Request, web.Application]


def fake_control_plane(seen: list[dict[str, Any]]) -> web.Application:
    async def answer(http: web.Request) -> web.StreamResponse:
        body = await http.read()
        seen.append(
            {
                "method": http.method,
                "path": http.rel_url.raw_path_qs,
                "headers": dict(http.headers),
                "body": body,
            }
        )
        if http.path.endswith("/content"):
            return web.Response(
                body=b'{"a":1}\n',
                content_type="application/octet-stream",
                headers={"Content-Disposition": 'attachment; filename="out.jsonl"'},
            )
        if http.path == "/v1/batches/missing":
            return web.json_response({"error": {"message": "no", "code": "not_found"}}, status=404)
        return web.json_response({"object": "list", "data": [], "got": len(body)})

    app = web.Application(client_max_size=1024**3)
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


def managed_router() -> Router:
    router = Router(ServerConfig(api_key=ROUTER_API_KEY))
    router.tenants.set_records([TenantRecord("acme", key_hashes=frozenset({hash_key(ACME_KEY)}))])
    return router


def run(router: Router, check: Callable[[Client, list[dict[str, Any]]], Awaitable[None]]) -> None:
    async def go() -> None:
        seen: list[dict[str, Any]] = []
        async with TestClient(TestServer(fake_control_plane(seen))) as plane:
            if router.control_plane is not None:
                base = str(plane.make_url("")).rstrip("/")
                router.control_plane = ControlPlaneLink(base, TOKEN)
            async with TestClient(TestServer(build_app(router))) as client:
                await check(client, seen)
        await router.state.close()

    asyncio.run(go())


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def test_the_batch_paths_go_to_the_control_plane_as_the_callers_tenant() -> None:
    router = managed_router()
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        answer = await client.get("/v1/batches?limit=2&after=batch_x", headers=auth(ACME_KEY))
        assert answer.status == 200 and (await answer.json())["object"] == "list"
        upload = await client.post(
            "/v1/files",
            data=b"--b\r\nbody\r\n--b--\r\n",
            headers=auth(ACME_KEY, **{"Content-Type": "multipart/form-data; boundary=b"}),
        )
        assert (await upload.json())["got"] == 18
        content = await client.get("/v1/files/file-1/content", headers=auth(ACME_KEY))
        assert await content.read() == b'{"a":1}\n'
        assert content.headers["Content-Disposition"] == 'attachment; filename="out.jsonl"'
        missing = await client.post("/v1/batches/missing", headers=auth(ACME_KEY))
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "not_found"
        # The router's own key acting for a tenant forwards as that tenant.
        acting = await client.get(
            "/v1/files", headers=auth(ROUTER_API_KEY, **{"X-Syshax-Tenant": "acme"})
        )
        assert acting.status == 200
        own = await client.get("/v1/files", headers=auth(ROUTER_API_KEY))
        assert own.status == 200

        assert [(s["method"], s["path"]) for s in seen] == [
            ("GET", "/v1/batches?limit=2&after=batch_x"),
            ("POST", "/v1/files"),
            ("GET", "/v1/files/file-1/content"),
            ("POST", "/v1/batches/missing"),
            ("GET", "/v1/files"),
            ("GET", "/v1/files"),
        ]
        tenants = [s["headers"]["X-Syshax-Tenant"] for s in seen]
        assert tenants == ["acme"] * 5 + ["router-key"]
        assert {s["headers"]["Authorization"] for s in seen} == {f"Bearer {TOKEN}"}
        assert seen[1]["headers"]["Content-Type"] == "multipart/form-data; boundary=b"

    run(router, check)


def test_a_caller_without_a_key_never_reaches_the_control_plane() -> None:
    router = managed_router()
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        answer = await client.get("/v1/batches", headers=auth("sk-shx-wrong"))
        assert answer.status == 401
        assert seen == []

    run(router, check)


def test_a_standalone_router_answers_404_in_openai_shape() -> None:
    router = managed_router()

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        for path in ("/v1/batches", "/v1/files/file-1/content"):
            answer = await client.get(path, headers=auth(ACME_KEY))
            assert answer.status == 404
            error = (await answer.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "managed by the control plane" in error["message"]

    run(router, check)


def test_a_control_plane_that_does_not_answer_is_a_503() -> None:
    router = managed_router()

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        router.control_plane = ControlPlaneLink("http://127.0.0.1:9", TOKEN)
        answer = await client.get("/v1/batches/batch_1", headers=auth(ACME_KEY))
        assert answer.status == 503
        error = (await answer.json())["error"]
        assert error["code"] == "control_plane_unavailable"
        assert "Retry-After" in answer.headers

    run(router, check)


def test_an_upload_over_the_cap_is_refused_before_it_is_forwarded(monkeypatch: Any) -> None:
    monkeypatch.setattr(batches, "MAX_UPLOAD_BYTES", 1024)
    router = Router(ServerConfig(api_key=ROUTER_API_KEY, max_body_bytes=512))
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        answer = await client.post("/v1/files", data=b"x" * 2048, headers=auth(ROUTER_API_KEY))
        assert answer.status == 413
        assert "1024 bytes" in (await answer.json())["error"]["message"]
        fits = await client.post("/v1/files", data=b"x" * 1000, headers=auth(ROUTER_API_KEY))
        assert fits.status == 200 and (await fits.json())["got"] == 1000  # over max_body_bytes
        assert len(seen) == 1

    run(router, check)
