"""Every path on the router is admitted (decision record 53): the catch-all's engine paths
count against the tenant's RPM and keep to its models as completions do, ``/v1/models``
lists only the models the tenant may use, and ``/metrics`` names no tenant unless asked
with the metrics token (decision record 54). In-process: a router in front of recording
engines, no child process."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from recording_engine import RecordingEngine

from common.policy_schema import PolicyKnobs
from common.routing import DeploymentSpec
from common.tenants import TenantRecord, hash_key
from router.api.app import build_app
from router.cli import StartupError, add_arguments, metrics_token
from router.state import PolicyRecord, Router, ServerConfig

ROUTER_API_KEY = "router-api-key"
METRICS_TOKEN = "metrics-token"
ACME_KEY = "sk-shx-acme-key"
OTHER_KEY = "sk-shx-other-key"

Client = TestClient[web.Request, web.Application]


def acme(**fields: Any) -> TenantRecord:
    return TenantRecord("acme", key_hashes=frozenset({hash_key(ACME_KEY)}), **fields)


OTHER = TenantRecord("globex", key_hashes=frozenset({hash_key(OTHER_KEY)}))


@pytest.fixture
def engines() -> Iterator[dict[str, RecordingEngine]]:
    """Two deployments: model ``m`` and model ``n``, each on its own recording engine."""
    made = {"m": RecordingEngine(), "n": RecordingEngine()}
    yield made
    for engine in made.values():
        engine.close()


def router_for(
    engines: dict[str, RecordingEngine], *tenants: TenantRecord, **config: Any
) -> Router:
    router = Router(ServerConfig(api_key=ROUTER_API_KEY, **config))
    router.tenants.set_records(tenants)
    router.state.set_policy(PolicyRecord("default", 1, PolicyKnobs(mode="gpu-only")))
    router.state.set_deployments(
        [
            DeploymentSpec(
                id=index,
                name=f"d-{model}",
                model=model,
                policy="default",
                pd_protocol="vllm",
                gpu_url=engine.url,
                cpu_url=None,
            )
            for index, (model, engine) in enumerate(sorted(engines.items()), start=1)
        ]
    )
    return router


def run(router: Router, check: Callable[[Client], Awaitable[None]]) -> None:
    async def go() -> None:
        async with TestClient(TestServer(build_app(router))) as client:
            await check(client)
        await router.state.close()

    asyncio.run(go())


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def error_of(answer: Any, status: int) -> dict[str, Any]:
    assert answer.status == status, await answer.text()
    error: dict[str, Any] = (await answer.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sent(engines: dict[str, RecordingEngine]) -> list[tuple[str, str, str]]:
    return [(model, s.method, s.path) for model, e in engines.items() for s in e.requests()]


# -- admission -------------------------------------------------------------------------------


def test_an_engine_path_with_an_empty_rpm_bucket_is_a_429_that_reaches_no_engine(
    engines: dict[str, RecordingEngine],
) -> None:
    router = router_for(engines, acme(rpm_limit=2), OTHER)

    async def check(client: Client) -> None:
        first = await client.post(
            "/tokenize", json={"model": "m", "prompt": "x"}, headers=auth(ACME_KEY)
        )
        second = await client.get("/version", headers=auth(ACME_KEY))
        assert (first.status, second.status) == (200, 200)
        for method, path in (("POST", "/tokenize"), ("GET", "/version"), ("POST", "/detokenize")):
            refused = await client.request(
                method, path, json={"model": "m"}, headers=auth(ACME_KEY)
            )
            error = await error_of(refused, 429)
            assert error["code"] == "rpm_limit_exceeded"
            assert int(refused.headers["Retry-After"]) >= 1
        other = await client.post("/tokenize", json={"prompt": "x"}, headers=auth(OTHER_KEY))
        assert other.status == 200  # another tenant is not held

    run(router, check)
    assert len(sent(engines)) == 3
    usage = router.tenants.take_usage()
    assert usage["acme"]["requests"] == 2 and usage["acme"]["rejected"] == {"rpm": 3}


def test_an_engine_path_naming_a_model_the_tenant_may_not_use_is_a_403(
    engines: dict[str, RecordingEngine],
) -> None:
    router = router_for(engines, acme(models=("m",)))

    async def check(client: Client) -> None:
        for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
            refused = await client.post(
                path, json={"model": "n", "prompt": "x"}, headers=auth(ACME_KEY)
            )
            error = await error_of(refused, 403)
            assert (error["code"], error["param"]) == ("model_not_allowed", "model")
        allowed = await client.post(
            "/tokenize", json={"model": "m", "prompt": "x"}, headers=auth(ACME_KEY)
        )
        assert allowed.status == 200

    run(router, check)
    assert sent(engines) == [("m", "POST", "/tokenize")]
    assert router.tenants.take_usage()["acme"]["rejected"] == {"model": 3}


def test_a_request_naming_no_model_goes_only_to_a_model_the_tenant_may_use(
    engines: dict[str, RecordingEngine],
) -> None:
    # The deployments are ordered m, n: a tenant of n must not land on m's engine.
    router = router_for(
        engines,
        acme(models=("n",)),
        TenantRecord("none", frozenset({hash_key(OTHER_KEY)}), models=("z",)),
    )

    async def check(client: Client) -> None:
        for _ in range(3):
            answer = await client.get("/version", headers=auth(ACME_KEY))
            assert answer.status == 200
        tokens = await client.post("/tokenize", json={"prompt": "x"}, headers=auth(ACME_KEY))
        assert tokens.status == 200
        nothing = await client.get("/version", headers=auth(OTHER_KEY))
        assert (await error_of(nothing, 403))["code"] == "model_not_allowed"

    run(router, check)
    assert {model for model, *_ in sent(engines)} == {"n"}


def test_the_models_list_shows_only_the_tenants_models(
    engines: dict[str, RecordingEngine],
) -> None:
    router = router_for(engines, acme(models=("n",)), OTHER)

    async def check(client: Client) -> None:
        async def ids(key: str) -> list[str]:
            answer = await client.get("/v1/models", headers=auth(key))
            return [model["id"] for model in (await answer.json())["data"]]

        assert await ids(ACME_KEY) == ["n"]
        assert await ids(OTHER_KEY) == ["m", "n"]
        assert await ids(ROUTER_API_KEY) == ["m", "n"]

    run(router, check)


# -- /metrics --------------------------------------------------------------------------------


async def count_one_request_each(client: Client) -> None:
    for key in (ACME_KEY, OTHER_KEY):
        assert (await client.get("/version", headers=auth(key))).status == 200


def test_an_open_metrics_page_names_no_tenant(engines: dict[str, RecordingEngine]) -> None:
    router = router_for(engines, acme(), OTHER)

    async def check(client: Client) -> None:
        await count_one_request_each(client)
        page = await client.get("/metrics")
        assert page.status == 200
        text = await page.text()
        assert "syshax_router_requests_total" in text and "syshax_router_refusals_total" in text
        assert "acme" not in text and "globex" not in text
        assert "syshax_router_tenant_" not in text and "tenant=" not in text

    run(router, check)


def test_with_a_metrics_token_the_page_needs_it_and_then_lists_the_tenants(
    engines: dict[str, RecordingEngine],
) -> None:
    router = router_for(engines, acme(), OTHER, metrics_token=METRICS_TOKEN)

    async def check(client: Client) -> None:
        await count_one_request_each(client)
        for headers in ({}, auth(ROUTER_API_KEY), auth(ACME_KEY), auth("metrics-tokenX")):
            refused = await client.get("/metrics", headers=headers)
            assert (await error_of(refused, 401))["code"] == "invalid_api_key"
        page = await client.get("/metrics", headers=auth(METRICS_TOKEN))
        assert page.status == 200
        text = await page.text()
        assert 'syshax_router_tenant_requests_total{outcome="ok",tenant="acme"} 1.0' in text
        assert 'tenant="globex"' in text
        health = await client.get("/health")
        assert health.status == 200  # /health stays open

    run(router, check)


def test_the_metrics_token_comes_from_the_flag_or_the_environment_and_is_no_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args(list(argv))

    assert metrics_token(parse(), ()) is None
    assert metrics_token(parse("--metrics-token", "t1"), ()) == "t1"
    monkeypatch.setenv("SYSHAX_ROUTER_METRICS_TOKEN", "t2")
    assert metrics_token(parse(), ()) == "t2"
    with pytest.raises(StartupError, match="must differ"):
        metrics_token(parse("--api-key", "k", "--metrics-token", "k"), ())
    with pytest.raises(StartupError, match="must differ"):
        metrics_token(parse("--metrics-token", "b"), ("b",))
