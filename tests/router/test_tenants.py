"""Tenants in the router (docs/router.md, "Tenants"): a key finds its tenant, a revoked one is
a 401, the RPM and TPM buckets refuse with a 429 and Retry-After in OpenAI's shape, settle
corrects a charge to what was used, only the router's own key acts for a tenant, and every
request is counted per tenant. In-process: no engine, no child process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.policy_schema import PolicyKnobs
from common.tenants import TenantRecord, hash_key
from router.api.app import build_app, errors_middleware
from router.client.errors import RouterError, error_response
from router.client.tenants import (
    REQUEST_TENANT,
    TENANT_HEADER,
    Tenants,
    estimate_tokens,
)
from router.metrics import RouterMetrics
from router.policy.standalone import StandalonePolicy
from router.state import ROUTER_KEY, Router, ServerConfig

ROUTER_KEY_TEXT = "sxk_router"
BENCH_KEY = "sxk_bench"
ACME_KEY = "sk-shx-acme-key"
OTHER_KEY = "sk-shx-other-key"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def acme(**fields: Any) -> TenantRecord:
    base: dict[str, Any] = {
        "name": "acme",
        "key_hashes": frozenset({hash_key(ACME_KEY)}),
        "rpm_limit": 0,
        "tpm_limit": 0,
        "models": (),
    }
    return TenantRecord(**{**base, **fields})


OTHER = TenantRecord("other", frozenset({hash_key(OTHER_KEY)}))


def table(
    *records: TenantRecord, api_key: str | None = ROUTER_KEY_TEXT
) -> tuple[Tenants, Clock, RouterMetrics]:
    clock, metrics = Clock(), RouterMetrics()
    tenants = Tenants(api_key, (BENCH_KEY,), metrics, clock=clock)
    tenants.set_records(records)
    return tenants, clock, metrics


def bearer(key: str) -> str:
    return f"Bearer {key}"


def refused(call: Callable[[], object], status: int, code: str) -> RouterError:
    with pytest.raises(RouterError) as caught:
        call()
    assert (caught.value.status, caught.value.code) == (status, code), caught.value.message
    return caught.value


def sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


# -- who is calling ---------------------------------------------------------------------------


def test_a_key_finds_its_tenant_and_the_router_keys_stand_for_router_key() -> None:
    tenants, _, _ = table(acme(), OTHER)
    assert tenants.authenticate(bearer(ACME_KEY)).name == "acme"
    assert tenants.authenticate(bearer(OTHER_KEY)).name == "other"
    assert tenants.authenticate(bearer(ROUTER_KEY_TEXT)).name == "router-key"
    assert tenants.authenticate(bearer(BENCH_KEY)).name == "router-key"
    router_tenant = tenants.authenticate(bearer(ROUTER_KEY_TEXT))
    assert (router_tenant.rpm_limit, router_tenant.tpm_limit, router_tenant.models) == (0, 0, ())
    assert router_tenant.default_class == "standard"


def test_an_unknown_or_revoked_key_is_a_401() -> None:
    tenants, _, _ = table(acme(), OTHER)
    for header in ("", "Bearer ", bearer("sk-shx-nobody"), ACME_KEY, "Basic abc"):
        refused(lambda h=header: tenants.authenticate(h), 401, "invalid_api_key")
    # Revoked: the next document no longer carries the key.
    tenants.set_records([OTHER])
    refused(lambda: tenants.authenticate(bearer(ACME_KEY)), 401, "invalid_api_key")
    assert tenants.authenticate(bearer(OTHER_KEY)).name == "other"


def test_a_router_without_a_key_or_a_tenant_is_open() -> None:
    tenants, _, _ = table(api_key=None)
    assert tenants.open
    assert tenants.authenticate("").name == "anonymous"
    assert tenants.authenticate(bearer("anything")).name == "anonymous"
    assert tenants.authenticate(bearer(BENCH_KEY)).name == "router-key"  # as before: no 401
    tenants.set_records([acme()])
    assert not tenants.open
    refused(lambda: tenants.authenticate(""), 401, "invalid_api_key")
    assert tenants.authenticate(bearer(ACME_KEY)).name == "acme"


def test_only_the_router_key_may_act_for_a_tenant() -> None:
    tenants, _, _ = table(acme(), OTHER)
    router_tenant = tenants.authenticate(bearer(ROUTER_KEY_TEXT))
    assert tenants.act_as(router_tenant, "acme").name == "acme"
    err = refused(
        lambda: tenants.act_as(tenants.authenticate(bearer(OTHER_KEY)), "acme"),
        403,
        "tenant_header_not_allowed",
    )
    assert err.param == TENANT_HEADER
    refused(lambda: tenants.act_as(router_tenant, "nobody"), 403, "unknown_tenant")


# -- limits -----------------------------------------------------------------------------------


def test_a_model_the_tenant_may_not_use_is_a_403() -> None:
    tenants, _, metrics = table(acme(models=("m",)))
    tenant = tenants.authenticate(bearer(ACME_KEY))
    tenants.admit(tenant, "m", 10)
    err = refused(lambda: tenants.admit(tenant, "other-model", 10), 403, "model_not_allowed")
    assert err.param == "model"
    assert sample(metrics, "syshax_router_tenant_rejections_total", tenant="acme", reason="model")


def test_the_request_past_the_rpm_limit_is_a_429_with_retry_after() -> None:
    tenants, clock, metrics = table(acme(rpm_limit=3))
    tenant = tenants.authenticate(bearer(ACME_KEY))
    for _ in range(3):
        tenants.admit(tenant, "m", 10)
    err = refused(lambda: tenants.admit(tenant, "m", 10), 429, "rpm_limit_exceeded")
    # One request's room comes back after 60 s / 3.
    assert err.retry_after == pytest.approx(20.0)
    response = error_response(err)
    assert response.headers["Retry-After"] == "20"
    assert response.body is not None
    body = json.loads(bytes(response.body))  # type: ignore[arg-type]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "RPM" in body["error"]["message"] and "limit 3" in body["error"]["message"]
    clock.now += 19.0
    refused(lambda: tenants.admit(tenant, "m", 10), 429, "rpm_limit_exceeded")
    clock.now += 1.0
    tenants.admit(tenant, "m", 10)
    assert (
        sample(metrics, "syshax_router_tenant_rejections_total", tenant="acme", reason="rpm") == 2
    )
    assert tenants.take_usage()["acme"]["rejected"] == {"rpm": 2}


def test_tpm_charges_an_estimate_and_settle_refunds_an_over_estimate() -> None:
    tenants, clock, _ = table(acme(tpm_limit=1200))
    tenant = tenants.authenticate(bearer(ACME_KEY))
    first = tenants.admit(tenant, "m", 800)
    err = refused(lambda: tenants.admit(tenant, "m", 800), 429, "tpm_limit_exceeded")
    # 400 tokens missing at 1200 a minute: 20 s.
    assert err.retry_after == pytest.approx(20.0)
    assert error_response(err).headers["Retry-After"] == "20"
    # The first used 100 of the 800 it was charged: the 700 come back at once.
    tenants.settle(first, 60, 40, ok=True)
    second = tenants.admit(tenant, "m", 800)
    # An under-estimate is owed: 800 charged, 1100 used, the bucket goes below zero.
    tenants.settle(second, 1000, 100, ok=True)
    err = refused(lambda: tenants.admit(tenant, "m", 1), 429, "tpm_limit_exceeded")
    assert err.retry_after is not None and err.retry_after > 0
    clock.now += 60.0
    tenants.admit(tenant, "m", 1)


def test_a_request_bigger_than_the_whole_tpm_waits_for_a_full_bucket() -> None:
    tenants, clock, _ = table(acme(tpm_limit=100))
    tenant = tenants.authenticate(bearer(ACME_KEY))
    big = tenants.admit(tenant, "m", 5000)
    assert big.charged == 100
    tenants.settle(big, 10, 10, ok=True)
    refused(lambda: tenants.admit(tenant, "m", 5000), 429, "tpm_limit_exceeded")
    clock.now += 12.0
    tenants.admit(tenant, "m", 5000)


def test_an_rpm_refusal_does_not_charge_tokens_and_a_tpm_refusal_no_request() -> None:
    tenants, clock, _ = table(acme(rpm_limit=2, tpm_limit=120))
    tenant = tenants.authenticate(bearer(ACME_KEY))
    tenants.admit(tenant, "m", 100)
    refused(lambda: tenants.admit(tenant, "m", 50), 429, "tpm_limit_exceeded")
    refused(lambda: tenants.admit(tenant, "m", 50), 429, "tpm_limit_exceeded")
    tenants.admit(tenant, "m", 20)  # both refusals left the RPM bucket alone
    refused(lambda: tenants.admit(tenant, "m", 60), 429, "rpm_limit_exceeded")
    clock.now += 30.0  # one request and 60 tokens come back
    tenants.admit(tenant, "m", 60)  # the RPM refusal charged no tokens


def test_a_rejected_admission_gives_its_tokens_back() -> None:
    tenants, _, metrics = table(acme(tpm_limit=100))
    tenant = tenants.authenticate(bearer(ACME_KEY))
    shed = tenants.admit(tenant, "m", 100)
    tenants.reject(tenant, "shed", shed)
    tenants.settle(shed, 5, 5, ok=False)  # over already: not counted again
    tenants.admit(tenant, "m", 100)
    tenants.reject(tenant, "class")
    usage = tenants.take_usage()["acme"]
    assert usage == {
        "requests": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "rejected": {"shed": 1, "class": 1},
    }
    assert sample(metrics, "syshax_router_tenant_requests_total", tenant="acme", outcome="rejected")
    assert sample(metrics, "syshax_router_tenant_rejections_total", tenant="acme", reason="shed")


def test_a_changed_limit_keeps_what_the_tenant_used() -> None:
    tenants, _, _ = table(acme(rpm_limit=2))
    tenant = tenants.authenticate(bearer(ACME_KEY))
    tenants.admit(tenant, "m", 1)
    tenants.admit(tenant, "m", 1)
    tenants.set_records([acme(rpm_limit=2), OTHER])  # another tenant added: acme's bucket stays
    refused(lambda: tenants.admit(tenant, "m", 1), 429, "rpm_limit_exceeded")
    tenants.set_records([acme(rpm_limit=0)])  # the limit lifted
    tenants.admit(tenant, "m", 1)


def test_usage_and_metrics_count_every_request_per_tenant() -> None:
    tenants, _, metrics = table(acme(), OTHER)
    acme_tenant = tenants.authenticate(bearer(ACME_KEY))
    tenants.settle(tenants.admit(acme_tenant, "m", 10), 12, 30, ok=True)
    tenants.settle(tenants.admit(acme_tenant, "m", 10), 12, 3, ok=False)
    other = tenants.authenticate(bearer(OTHER_KEY))
    tenants.settle(tenants.admit(other, "m", 10), 5, 5, ok=True)
    assert tenants.take_usage() == {
        "acme": {"requests": 2, "prompt_tokens": 24, "completion_tokens": 33, "rejected": {}},
        "other": {"requests": 1, "prompt_tokens": 5, "completion_tokens": 5, "rejected": {}},
    }
    assert tenants.take_usage() == {}  # deltas: taken once
    requests = "syshax_router_tenant_requests_total"
    assert sample(metrics, requests, tenant="acme", outcome="ok") == 1
    assert sample(metrics, requests, tenant="acme", outcome="error") == 1
    tokens = "syshax_router_tenant_tokens_total"
    assert sample(metrics, tokens, tenant="acme", kind="prompt") == 24
    assert sample(metrics, tokens, tenant="acme", kind="completion") == 33
    assert sample(metrics, tokens, tenant="other", kind="completion") == 5


def test_the_token_estimate_is_the_prompt_and_what_may_be_generated() -> None:
    assert estimate_tokens(400, 50) == 150
    assert estimate_tokens(400, None) == 100 + 256
    assert estimate_tokens(0, 0) == 1


# -- through the app's middleware -------------------------------------------------------------


async def whoami(http: web.Request) -> web.Response:
    return web.json_response({"tenant": http[REQUEST_TENANT].name})


Client = TestClient[web.Request, web.Application]


def with_app(router: Router, check: Callable[[Client, Client], Awaitable[None]]) -> None:
    """Run ``check`` with two clients: one of the router's middleware in front of a route
    that names the request's tenant, one of the router's own app."""

    async def run() -> None:
        app = web.Application(middlewares=[errors_middleware])
        app[ROUTER_KEY] = router
        app.router.add_get("/whoami", whoami)
        async with (
            TestClient(TestServer(app)) as client,
            TestClient(TestServer(build_app(router))) as real,
        ):
            await check(client, real)
        await router.state.close()

    asyncio.run(run())


def test_the_middleware_lets_in_by_key_and_acts_for_a_tenant_on_the_router_key_only() -> None:
    router = Router(ServerConfig(api_key=ROUTER_KEY_TEXT, benchmark_keys=(BENCH_KEY,)))
    router.tenants.set_records([acme(), OTHER])

    async def check(client: Client, real: Client) -> None:
        async def tenant_of(headers: dict[str, str]) -> tuple[int, Any]:
            answer = await client.get("/whoami", headers=headers)
            return answer.status, await answer.json()

        assert await tenant_of({"Authorization": bearer(ACME_KEY)}) == (200, {"tenant": "acme"})
        assert (await tenant_of({"Authorization": bearer(BENCH_KEY)}))[1] == {
            "tenant": "router-key"
        }
        status, body = await tenant_of({"Authorization": bearer("sk-shx-wrong")})
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
        assert set(body["error"]) == {"message", "type", "param", "code"}
        acting = {"Authorization": bearer(ROUTER_KEY_TEXT), TENANT_HEADER: "other"}
        assert await tenant_of(acting) == (200, {"tenant": "other"})
        status, body = await tenant_of({"Authorization": bearer(ACME_KEY), TENANT_HEADER: "other"})
        assert (status, body["error"]["code"]) == (403, "tenant_header_not_allowed")
        # The router's own endpoints: /health open, the rest behind a key.
        assert (await real.get("/health")).status in (200, 503)
        assert (await real.get("/v1/models")).status == 401
        models = await real.get("/v1/models", headers={"Authorization": bearer(ACME_KEY)})
        assert models.status == 200

    with_app(router, check)


def test_an_open_router_serves_everyone_as_anonymous() -> None:
    router = Router(ServerConfig())

    async def check(client: Client, real: Client) -> None:
        answer = await client.get("/whoami")
        assert (answer.status, await answer.json()) == (200, {"tenant": "anonymous"})
        refused = await client.get("/whoami", headers={TENANT_HEADER: "acme"})
        assert (await refused.json())["error"]["code"] == "tenant_header_not_allowed"

    with_app(router, check)


# -- standalone: the tenants file -------------------------------------------------------------


def test_the_tenants_file_is_reloaded_on_hangup_and_a_bad_one_is_kept_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [acme(rpm_limit=5).as_document()]}))
    router = Router(ServerConfig())
    source = StandalonePolicy(router, None, {}, str(path))
    assert source.reload_tenants()
    assert router.tenants.authenticate(bearer(ACME_KEY)).rpm_limit == 5
    bad = acme().as_document() | {"tpm_limit": -1}
    path.write_text(json.dumps({"tenants": [bad]}))
    source.hangup()
    assert "tenants[0].tpm_limit" in caplog.text
    assert router.tenants.authenticate(bearer(ACME_KEY)).rpm_limit == 5
    path.write_text(json.dumps({"tenants": [OTHER.as_document()]}))
    source.hangup()
    refused(lambda: router.tenants.authenticate(bearer(ACME_KEY)), 401, "invalid_api_key")


def test_a_bad_tenants_file_stops_the_router_at_start_naming_the_field(tmp_path: Path) -> None:
    import argparse

    from router.cli import StartupError, add_arguments, compose

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "Bad Name"}]}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--gpu-url", "http://127.0.0.1:9", "--model", "m"])
    args.tenants_file = str(path)
    with pytest.raises(StartupError, match=r"tenants\[0\]\.name"):
        asyncio.run(compose(args))


# -- end to end: a tenant held to its RPM through real requests -------------------------------


def test_a_tenant_is_held_to_its_rpm_through_real_requests() -> None:
    from recording_engine import RecordingEngine
    from router_procs import MODEL

    from common.routing import DeploymentSpec
    from router.state import PolicyRecord

    engine = RecordingEngine()
    router = Router(ServerConfig(api_key=ROUTER_KEY_TEXT))
    router.tenants.set_records([acme(rpm_limit=2), OTHER])
    knobs = PolicyKnobs(mode="gpu-only")
    router.state.set_policy(PolicyRecord("default", 1, knobs))
    spec = DeploymentSpec(
        id=1,
        name="d",
        model=MODEL,
        policy="default",
        pd_protocol="vllm",
        gpu_url=engine.url,
        cpu_url=None,
    )
    router.state.set_deployments([spec])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def check() -> None:
        async with TestClient(TestServer(build_app(router))) as client:

            async def ask(key: str) -> tuple[int, dict[str, str], Any]:
                answer = await client.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": bearer(key)}
                )
                return answer.status, dict(answer.headers), await answer.json()

            assert [(await ask(ACME_KEY))[0] for _ in range(2)] == [200, 200]
            status, headers, answer = await ask(ACME_KEY)
            assert status == 429, answer
            assert answer["error"]["code"] == "rpm_limit_exceeded"
            assert set(answer["error"]) == {"message", "type", "param", "code"}
            assert headers["Retry-After"] == "30"
            assert (await ask(OTHER_KEY))[0] == 200  # another tenant is not held
        await router.state.close()

    try:
        asyncio.run(check())
    finally:
        engine.close()
    assert len(engine.requests()) == 3
    usage = router.tenants.take_usage()
    assert usage["acme"]["requests"] == 2 and usage["acme"]["rejected"] == {"rpm": 1}
    assert usage["acme"]["completion_tokens"] > 0
    requests = "syshax_router_tenant_requests_total"
    assert sample(router.metrics, requests, tenant="acme", outcome="ok") == 2
    assert sample(router.metrics, requests, tenant="acme", outcome="rejected") == 1
