"""The router's upstreams are fixed maps, never a path join (decision record 53): every path
the router forwards, to the control plane (the Batch API) or to an engine (the catch-all),
is matched whole on the raw path the client sent, so no dot segment, encoded slash, double
encoding or other tail can reach another path upstream. Each probe goes over a plain socket
(an HTTP client would normalise the path first) to an in-process router in front of a
stand-in control plane and a recording engine, and must be a 404 in OpenAI's shape that
reached neither."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from recording_engine import RecordingEngine
from router_procs import MODEL

from common.policy_schema import PolicyKnobs
from common.routing import DeploymentSpec
from common.tenants import TenantRecord, hash_key
from router.api.app import build_app
from router.state import ControlPlaneLink, PolicyRecord, Router, ServerConfig

ACME_KEY = "sk-shx-acme-key"
TOKEN = "sxr_router-token"

# Ways to climb out of /v1/files or /v1/batches towards the control plane's /api/v1/...
BATCH_ESCAPES = [
    "/v1/files/../../api/v1/routing/tenants",
    "/v1/files/%2e%2e/%2e%2e/api/v1/routing/tenants",
    "/v1/files/%2E%2e/%2e%2E/api/v1/routing/tenants",
    "/v1/files/..%2f..%2fapi/v1/routing/tenants",
    "/v1/files/..%2F..%2Fapi%2Fv1%2Frouting%2Ftenants",
    "/v1/files%2f..%2f..%2fapi/v1/routing/tenants",
    "/v1/files/%252e%252e/%252e%252e/api/v1/routing/tenants",
    "/v1/files/file-abc.",
    "/v1/files/file-abc%2e",
    "/v1/files/file-abc/.",
    "/v1/files/./file-abc",
    "/v1/files//file-abc",
    "//v1/files",
    "/v1/files/",
    "/v1/files/file-abc/content/x",
    "/v1/files/file-abc/content/",
    "/v1/files/file-abc%2fcontent",
    "/v1/files/file-abc\\..\\..\\api",
    "/v1/files/\u2024\u2024/\u2024\u2024/api/v1/routing/tenants",
    "/v1/files/\uff0e\uff0e/\uff0e\uff0e/api/v1/routing/tenants",
    "/v1/files/\u3002\u3002/api",
    "/v1/files/%E2%80%A4%E2%80%A4/%E2%80%A4%E2%80%A4/api/v1/routing/tenants",
    "/v1/files/%EF%BC%8E%EF%BC%8E/api/v1/routing/tenants",
    "/v1/files/%E3%80%82%E3%80%82/api",
    "/v1/files/%66ile-abc",
    "/v1/batches/../../api/v1/routing/tenants",
    "/v1/batches/%2e%2e/%2e%2e/api/v1/routing/tenants",
    "/v1/batches/batch_abc/cancel/..",
    "/v1/batches/batch_abc/cancel%2f..%2f..",
    "/v1/batches/batch_abc/%2e",
    "/v1/batches/batch_abc.",
    "/v1/batches/batch_abc;x",
    "/v1/batches/batch-abc",
    "/v1/batches/file-abc",
]
# Ways to make a listed engine path mean another one (vLLM's admin paths among them).
ENGINE_ESCAPES = [
    "/tokenize/..%2f..",
    "/tokenize/../collective_rpc",
    "/tokenize/%2e%2e/collective_rpc",
    "/version/.",
    "/version/",
    "/./version",
    "//version",
    "/%2Fversion",
    "/%76ersion",
    "/version%2f",
    "/version.",
    "/v1/embeddings/..",
    "/v1//embeddings",
    "/v1/chat/%63ompletions",
    "/v1/chat/completions/..",
    "/v1/files/../../tokenize",
]


def raw_request(port: int, method: str, target: str, headers: dict[str, str]) -> bytes:
    """One request over a plain socket, the target sent byte for byte (UTF-8)."""
    lines = [f"{method} {target} HTTP/1.1", "Host: x", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    body = b'{"prompt": "x"}' if method == "POST" else b""
    head = head.replace(b"\r\n\r\n", f"\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        parts = []
        while data := sock.recv(1 << 16):
            parts.append(data)
    return b"".join(parts)


def status_and_json(answer: bytes) -> tuple[int, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


class Harness:
    """An in-process router (managed, one deployment on a recording engine) in front of a
    stand-in control plane that records every request it gets."""

    def __init__(self) -> None:
        self.plane_seen: list[str] = []
        self.engine = RecordingEngine()
        self.router = Router(ServerConfig(api_key="router-api-key"))
        self.router.tenants.set_records(
            [TenantRecord("acme", key_hashes=frozenset({hash_key(ACME_KEY)}))]
        )
        self.router.state.set_policy(PolicyRecord("default", 1, PolicyKnobs(mode="gpu-only")))
        spec = DeploymentSpec(
            id=1,
            name="d",
            model=MODEL,
            policy="default",
            pd_protocol="vllm",
            gpu_url=self.engine.url,
            cpu_url=None,
        )
        self.router.state.set_deployments([spec])

    def probe(self, cases: list[tuple[str, str]]) -> list[tuple[str, str, int, Any]]:
        """Each (method, raw target) sent to the router; what came back."""

        async def plane_answer(http: web.Request) -> web.Response:
            self.plane_seen.append(http.raw_path)
            return web.json_response({"tenants": ["every tenant's key hashes"]})

        async def go() -> list[tuple[str, str, int, Any]]:
            plane = web.Application()
            plane.router.add_route("*", "/{tail:.*}", plane_answer)
            async with TestServer(plane) as plane_server:
                base = str(plane_server.make_url("")).rstrip("/")
                self.router.control_plane = ControlPlaneLink(base, TOKEN)
                async with TestServer(build_app(self.router)) as server:
                    assert server.port is not None
                    results = []
                    for method, target in cases:
                        answer = await asyncio.to_thread(
                            raw_request,
                            server.port,
                            method,
                            target,
                            {"Authorization": f"Bearer {ACME_KEY}"},
                        )
                        results.append((method, target, *status_and_json(answer)))
            await self.router.state.close()
            return results

        return asyncio.run(go())


@pytest.fixture
def harness() -> Iterator[Harness]:
    made = Harness()
    yield made
    made.engine.close()


def assert_openai_404(results: list[tuple[str, str, int, Any]]) -> None:
    for method, target, status, body in results:
        assert status == 404, (method, target, status, body)
        assert isinstance(body, dict), (target, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, (target, body)
        assert body["error"]["code"] == "not_found", (target, body)


def test_no_batch_path_climbs_out_of_the_batch_api(harness: Harness) -> None:
    cases = [(m, path) for path in BATCH_ESCAPES if path.isascii() for m in ("GET", "POST")]
    assert_openai_404(harness.probe(cases))
    assert harness.plane_seen == []
    assert harness.engine.requests() == []


def test_no_engine_path_names_another_one(harness: Harness) -> None:
    cases = [(method, path) for path in ENGINE_ESCAPES for method in ("GET", "POST")]
    assert_openai_404(harness.probe(cases))
    assert harness.plane_seen == []
    assert harness.engine.requests() == []


def test_a_target_with_raw_unicode_bytes_is_refused_before_the_app(harness: Harness) -> None:
    """Unencoded UTF-8 in the request line (U+2024, U+FF0E, U+3002) never gets past the HTTP
    parser: a 400 from the server itself, with nothing forwarded."""
    cases = [("GET", p) for p in BATCH_ESCAPES if not p.isascii()]
    assert cases
    for method, target, status, _ in harness.probe(cases):
        assert status in (400, 404), (method, target, status)
    assert harness.plane_seen == []
    assert harness.engine.requests() == []


def test_the_listed_paths_still_go_upstream_as_the_fixed_path(harness: Harness) -> None:
    results = harness.probe(
        [
            ("GET", "/v1/files"),
            ("GET", "/v1/files/file-0123456789abcdef01234567/content"),
            ("POST", "/v1/batches/batch_0123456789abcdef01234567/cancel"),
            ("GET", "/version"),
            ("POST", "/tokenize"),
            ("PUT", "/v1/files/file-abc"),
            ("POST", "/v1/files/file-abc/content"),
        ]
    )
    assert [status for *_, status, _ in results] == [200, 200, 200, 200, 200, 405, 405]
    assert results[-1][3]["error"]["code"] == "method_not_allowed"
    assert harness.plane_seen == [
        "/v1/files",
        "/v1/files/file-0123456789abcdef01234567/content",
        "/v1/batches/batch_0123456789abcdef01234567/cancel",
    ]
    assert [(s.method, s.path) for s in harness.engine.requests()] == [
        ("GET", "/version"),
        ("POST", "/tokenize"),
    ]
