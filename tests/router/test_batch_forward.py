"""The router hands the Batch API's paths to its control plane, as the caller's tenant."""

from __future__ import annotations

import asyncio
import hashlib
import os
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
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
        # Read as it streams, hashed, so a large upload is checked byte for byte.
        digest, size, head = hashlib.sha256(), 0, b""
        async for chunk in http.content.iter_any():
            digest.update(chunk)
            size += len(chunk)
            head = (head + chunk)[:4096]
        seen.append(
            {
                "method": http.method,
                "path": http.rel_url.raw_path_qs,
                "headers": dict(http.headers),
                "body": head,
                "size": size,
                "sha256": digest.hexdigest(),
            }
        )
        if http.path.endswith("/content"):
            return web.Response(
                body=b'{"a":1}\n',
                content_type="application/octet-stream",
                headers={"Content-Disposition": 'attachment; filename="out.jsonl"'},
            )
        if http.path == "/v1/batches/batch_missing":
            return web.json_response({"error": {"message": "no", "code": "not_found"}}, status=404)
        return web.json_response({"object": "list", "data": [], "got": size})

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


def test_a_tenants_call_goes_upstream_with_its_own_key_and_no_tenant_header() -> None:
    router = managed_router()
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        answer = await client.get(
            "/v1/batches?limit=2&after=batch_x&order=desc&purpose=a%2F..",
            headers=auth(ACME_KEY, **{"Idempotency-Key": "k1", "Cookie": "s=1"}),
        )
        assert answer.status == 200 and (await answer.json())["object"] == "list"
        upload = await client.post(
            "/v1/files",
            data=b"--b\r\nbody\r\n--b--\r\n",
            headers=auth(ACME_KEY, **{"Content-Type": "multipart/form-data; boundary=b"}),
        )
        assert (await upload.json())["got"] == 18
        files = await client.get("/v1/files?purpose=batch%2F..%2Fx&limit=5", headers=auth(ACME_KEY))
        assert files.status == 200
        content = await client.get("/v1/files/file-1/content", headers=auth(ACME_KEY))
        assert await content.read() == b'{"a":1}\n'
        assert content.headers["Content-Disposition"] == 'attachment; filename="out.jsonl"'
        missing = await client.get("/v1/batches/batch_missing", headers=auth(ACME_KEY))
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "not_found"
        cancel = await client.post("/v1/batches/batch_1/cancel", headers=auth(ACME_KEY))
        assert cancel.status == 200
        deleted = await client.delete("/v1/files/file-1", headers=auth(ACME_KEY))
        assert deleted.status == 200

        assert [(s["method"], s["path"]) for s in seen] == [
            ("GET", "/v1/batches?after=batch_x&limit=2"),  # known parameters only
            ("POST", "/v1/files"),
            ("GET", "/v1/files?limit=5&purpose=batch%2F..%2Fx"),  # encoded again
            ("GET", "/v1/files/file-1/content"),
            ("GET", "/v1/batches/batch_missing"),
            ("POST", "/v1/batches/batch_1/cancel"),
            ("DELETE", "/v1/files/file-1"),
        ]
        for request in seen:
            assert request["headers"]["Authorization"] == f"Bearer {ACME_KEY}"
            assert "X-Syshax-Tenant" not in request["headers"]
            assert "Cookie" not in request["headers"]
        assert seen[0]["headers"]["Idempotency-Key"] == "k1"
        assert seen[1]["headers"]["Content-Type"] == "multipart/form-data; boundary=b"

    run(router, check)


def test_the_router_keys_call_goes_with_the_machine_token_as_router_key() -> None:
    router = managed_router()
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        own = await client.get("/v1/files", headers=auth(ROUTER_API_KEY))
        assert own.status == 200
        named = await client.get(
            "/v1/files", headers=auth(ROUTER_API_KEY, **{"X-Syshax-Tenant": "router-key"})
        )
        assert named.status == 200
        assert [s["headers"]["Authorization"] for s in seen] == [f"Bearer {TOKEN}"] * 2
        assert [s["headers"]["X-Syshax-Tenant"] for s in seen] == ["router-key"] * 2

    run(router, check)


def test_an_open_routers_caller_goes_with_the_machine_token_as_anonymous() -> None:
    router = Router(ServerConfig())
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        answer = await client.get("/v1/batches", headers=auth("anything"))
        assert answer.status == 200
        [request] = seen
        assert request["headers"]["Authorization"] == f"Bearer {TOKEN}"
        assert request["headers"]["X-Syshax-Tenant"] == "anonymous"

    run(router, check)


def test_the_router_key_acting_for_a_tenant_is_refused_and_nothing_goes_upstream() -> None:
    router = managed_router()
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        for method, path in (("GET", "/v1/files"), ("POST", "/v1/batches")):
            acting = await client.request(
                method, path, headers=auth(ROUTER_API_KEY, **{"X-Syshax-Tenant": "acme"})
            )
            assert acting.status == 403
            error = (await acting.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "tenant_header_not_allowed"
        # A tenant's own key naming a tenant is refused by the key check already.
        other = await client.get("/v1/files", headers=auth(ACME_KEY, **{"X-Syshax-Tenant": "acme"}))
        assert other.status == 403
        assert seen == []
        refusals = router.metrics.registry.get_sample_value(
            "syshax_router_refusals_total", {"reason": "tenant-header"}
        )
        assert refusals == 2

    run(router, check)


def test_a_batch_api_call_counts_against_the_tenants_rpm() -> None:
    router = Router(ServerConfig(api_key=ROUTER_API_KEY))
    record = TenantRecord("acme", key_hashes=frozenset({hash_key(ACME_KEY)}), rpm_limit=2)
    router.tenants.set_records([record])
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        statuses = []
        for _ in range(3):
            answer = await client.get("/v1/batches", headers=auth(ACME_KEY))
            statuses.append(answer.status)
        assert statuses == [200, 200, 429]
        assert (await answer.json())["error"]["code"] == "rpm_limit_exceeded"
        assert "Retry-After" in answer.headers
        assert len(seen) == 2
        usage = router.tenants.take_usage()["acme"]
        assert usage["requests"] == 2 and usage["rejected"] == {"rpm": 1}

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
        error = (await answer.json())["error"]
        assert error["code"] == "body_too_large" and "1024 bytes" in error["message"]
        chunked = await client.post(
            "/v1/files", data=chunks(b"x" * 2048, 100), headers=auth(ROUTER_API_KEY)
        )
        assert chunked.status == 413
        assert (await chunked.json())["error"]["code"] == "body_too_large"
        fits = await client.post("/v1/files", data=b"x" * 1000, headers=auth(ROUTER_API_KEY))
        assert fits.status == 200 and (await fits.json())["got"] == 1000  # over max_body_bytes
        assert len(seen) == 1

    run(router, check)


async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    """``data`` as a chunked request body (no Content-Length)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_a_large_upload_reaches_the_control_plane_whole_and_streamed() -> None:
    router = managed_router()
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)
    data = os.urandom(12 * 1024 * 1024)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        sized = await client.post("/v1/files", data=data, headers=auth(ACME_KEY))
        assert sized.status == 200 and (await sized.json())["got"] == len(data)
        # A chunked body is spooled (past 1 MiB on disk) and sent with its length: the
        # control plane's web server refuses chunked uploads.
        chunked = await client.post("/v1/files", data=chunks(data, 100_000), headers=auth(ACME_KEY))
        assert chunked.status == 200 and (await chunked.json())["got"] == len(data)
        for request in seen:
            assert request["size"] == len(data)
            assert request["sha256"] == hashlib.sha256(data).hexdigest()
            assert request["headers"]["Content-Length"] == str(len(data))
            assert "Transfer-Encoding" not in request["headers"]

    run(router, check)


def test_an_upload_is_never_held_whole_in_the_routers_memory() -> None:
    """The router's allocations while a 24 MiB upload passes stay near its 1 MiB spool (the
    test's own copy of the data is made before tracing starts; the stand-in hashes as it
    reads)."""
    router = managed_router()
    router.control_plane = ControlPlaneLink("http://placeholder", TOKEN)
    data = os.urandom(24 * 1024 * 1024)

    async def check(client: Client, seen: list[dict[str, Any]]) -> None:
        # Sent a chunk at a time, so the client's socket buffer holds no copy either.
        sized = auth(ACME_KEY, **{"Content-Length": str(len(data))})
        for headers in (sized, auth(ACME_KEY)):
            tracemalloc.start()
            try:
                body = chunks(data, 256 * 1024)
                answer = await client.post("/v1/files", data=body, headers=headers)
                assert answer.status == 200
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < 8 * 1024 * 1024, peak
        assert [request["size"] for request in seen] == [len(data)] * 2

    run(router, check)
