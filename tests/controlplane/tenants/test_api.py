"""The tenants' REST API: CRUD and keys for people, the routers' document and usage reports."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from common.tenants import hash_key, parse_tenants
from controlplane.core.models import AuditEntry
from controlplane.tenants import services
from controlplane.tenants.models import Tenant, TenantKey, TenantUsage

TENANT = {
    "name": "acme",
    "rpm_limit": 60,
    "tpm_limit": 10_000,
    "models": ["qwen"],
    "classes": ["standard", "batch"],
    "default_class": "standard",
}


@pytest.fixture
def tenant_operator(db) -> APIClient:
    """A person granted the tenants app's permissions through the normal mechanism."""
    user = User.objects.create_user("tenant-op", password="x-unused-x")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="tenants"))
    client = APIClient()
    client.force_authenticate(user)
    return client


def test_create_read_change_and_delete_a_tenant(tenant_operator) -> None:
    created = tenant_operator.post("/api/v1/tenants/", TENANT, format="json")
    assert created.status_code == 201, created.content
    assert {k: created.json()[k] for k in TENANT} == TENANT
    assert created.json()["active_keys"] == 0
    listed = tenant_operator.get("/api/v1/tenants/").json()["results"]
    assert [t["name"] for t in listed] == ["acme"]
    changed = tenant_operator.patch("/api/v1/tenants/acme/", {"rpm_limit": 120}, format="json")
    assert changed.status_code == 200, changed.content
    assert changed.json()["rpm_limit"] == 120
    assert tenant_operator.delete("/api/v1/tenants/acme/").status_code == 204
    assert not Tenant.objects.exists()
    actions = set(AuditEntry.objects.values_list("action", flat=True))
    assert actions >= {"tenant.created", "tenant.updated", "tenant.deleted"}


def test_bad_settings_are_a_400_naming_every_field(admin_client) -> None:
    body = {
        **TENANT,
        "name": "Bad Name",
        "classes": ["gold"],
        "models": ["a", "a"],
        "rpm_limit": -1,
    }
    response = admin_client.post("/api/v1/tenants/", body, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error["fields"]) == {"name", "classes", "models", "rpm_limit"}
    assert "unknown class 'gold'" in error["fields"]["classes"][0]
    response = admin_client.post("/api/v1/tenants/", {**TENANT, "rpm_limit": "many"}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("rpm_limit")


def test_the_name_does_not_change(admin_client, tenant) -> None:
    response = admin_client.patch("/api/v1/tenants/acme/", {"name": "acme-2"}, format="json")
    assert response.status_code == 400
    assert "does not change" in response.json()["error"]["fields"]["name"][0]


def test_a_key_is_returned_once_then_listed_without_it(admin_client, tenant) -> None:
    issued = admin_client.post("/api/v1/tenants/acme/keys", {"label": "ci"}, format="json")
    assert issued.status_code == 201, issued.content
    body = issued.json()
    plaintext = body["key"]
    assert issued["Cache-Control"] == "no-store"
    assert body["prefix"] == plaintext[:12] and body["label"] == "ci" and body["active"]
    assert TenantKey.objects.get().key_hash == hash_key(plaintext)
    listed = admin_client.get("/api/v1/tenants/acme/keys")
    assert listed.status_code == 200
    assert plaintext not in listed.content.decode()
    assert [k["prefix"] for k in listed.json()["results"]] == [plaintext[:12]]
    assert admin_client.get("/api/v1/tenants/acme/").json()["active_keys"] == 1


def test_revoking_a_key_changes_the_routers_document_and_its_etag(
    admin_client, router_client, tenant
) -> None:
    key, _ = services.issue_key(tenant, acting_user="test")
    first = router_client.get("/api/v1/routing/tenants")
    assert first.status_code == 200
    etag = first["ETag"]
    assert parse_tenants(first.json())[0].key_hashes == {key.key_hash}
    same = router_client.get("/api/v1/routing/tenants", HTTP_IF_NONE_MATCH=etag)
    assert same.status_code == 304 and same["ETag"] == etag

    revoked = admin_client.post(f"/api/v1/tenants/acme/keys/{key.pk}/revoke")
    assert revoked.status_code == 200, revoked.content
    assert revoked.json()["revoked_at"] is not None
    again = router_client.get("/api/v1/routing/tenants", HTTP_IF_NONE_MATCH=etag)
    assert again.status_code == 200 and again["ETag"] != etag
    assert again.json()["tenants"][0]["keys"] == []


def test_another_tenants_key_is_not_found_under_this_one(admin_client, tenant, make_tenant) -> None:
    key, _ = services.issue_key(make_tenant("other"), acting_user="test")
    assert admin_client.post(f"/api/v1/tenants/acme/keys/{key.pk}/revoke").status_code == 404
    assert TenantKey.objects.get().revoked_at is None


def test_the_usage_series_sums_routers_per_minute(
    admin_client, tenant, router_instance, other_router
) -> None:
    services_body = {
        "tenants": {"acme": {"requests": 2, "prompt_tokens": 5, "rejected": {"tpm": 1}}}
    }
    from controlplane.tenants.usage import record_usage

    record_usage(router_instance, services_body)
    record_usage(other_router, services_body)
    response = admin_client.get("/api/v1/tenants/acme/usage?window=5m")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["window"], len(body["minutes"])) == ("5m", 5)
    assert body["totals"] == {
        "requests": 4,
        "prompt_tokens": 10,
        "completion_tokens": 0,
        "rejected": {"tpm": 2},
    }
    bad = admin_client.get("/api/v1/tenants/acme/usage?window=1y")
    assert bad.status_code == 400
    assert bad.json()["error"]["message"].startswith("window")


def test_a_router_reports_its_own_usage_only(
    router_client, tenant, router_instance, other_router
) -> None:
    body = {"tenants": {"acme": {"requests": 3, "completion_tokens": 9}}}
    ok = router_client.post(f"/api/v1/routers/{router_instance.pk}/usage", body, format="json")
    assert ok.status_code == 200, ok.content
    assert ok.json() == {"accepted": ["acme"], "dropped": []}
    other = router_client.post(f"/api/v1/routers/{other_router.pk}/usage", body, format="json")
    assert other.status_code == 403
    assert TenantUsage.objects.get().requests == 3
    bad = router_client.post(
        f"/api/v1/routers/{router_instance.pk}/usage",
        {"tenants": {"acme": {"rejected": {"bored": 1}}}},
        format="json",
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["message"].startswith("tenants.acme.rejected.bored")


def test_a_router_cannot_report_impossible_or_another_routers_usage(
    router_client, tenant, router_instance, other_router
) -> None:
    """10^12 requests in one report is refused by name and limit; a second router's token
    cannot post to the first router's usage (docs/decisions/0057-...)."""
    huge = {"tenants": {"acme": {"requests": 10**12}}}
    refused = router_client.post(f"/api/v1/routers/{router_instance.pk}/usage", huge, format="json")
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert message.startswith("tenants.acme.requests") and "at most 600000" in message
    assert not TenantUsage.objects.exists()
    plausible = {"tenants": {"acme": {"requests": 120, "prompt_tokens": 4000}}}
    ok = router_client.post(f"/api/v1/routers/{router_instance.pk}/usage", plausible, format="json")
    assert ok.status_code == 200
    # router_client is router-a's token; router-b's row is not its own.
    other = router_client.post(f"/api/v1/routers/{other_router.pk}/usage", plausible, format="json")
    assert other.status_code == 403
    assert list(TenantUsage.objects.values_list("router__name", "requests")) == [("router-a", 120)]


CALLERS = ("anonymous", "user", "own_agent", "router", "operator", "admin")


@pytest.fixture
def clients(
    anonymous_client, user_client, agent_client, router_client, tenant_operator, admin_client
) -> dict[str, APIClient]:
    return {
        "anonymous": anonymous_client,
        "user": user_client,
        "own_agent": agent_client,
        "router": router_client,
        "operator": tenant_operator,
        "admin": admin_client,
    }


def test_the_permissions_matrix(clients, tenant, router_instance) -> None:
    key, _ = services.issue_key(tenant, acting_user="test")
    writers = {"operator", "admin"}
    people = {"user", "operator", "admin"}
    cases = [
        ("GET", "/api/v1/tenants/", None, {c: 200 for c in people}),
        ("GET", "/api/v1/tenants/acme/", None, {c: 200 for c in people}),
        ("GET", "/api/v1/tenants/acme/keys", None, {c: 200 for c in people}),
        ("GET", "/api/v1/tenants/acme/usage", None, {c: 200 for c in people}),
        ("PATCH", "/api/v1/tenants/acme/", {"rpm_limit": 1}, {c: 200 for c in writers}),
        ("POST", "/api/v1/tenants/acme/keys", {}, {c: 201 for c in writers}),
        ("POST", f"/api/v1/tenants/acme/keys/{key.pk}/revoke", {}, {c: 200 for c in writers}),
        ("POST", "/api/v1/tenants/", {"name": "t-{caller}"}, {c: 201 for c in writers}),
        ("GET", "/api/v1/routing/tenants", None, {"router": 200}),
        (
            "POST",
            f"/api/v1/routers/{router_instance.pk}/usage",
            {"tenants": {}},
            {"router": 200},
        ),
        # The operator deletes it; the admin, after, finds it gone.
        ("DELETE", "/api/v1/tenants/t-admin/", None, {"operator": 204, "admin": 404}),
    ]
    failures = []
    for method, path, body, allowed in cases:
        for caller in CALLERS:
            data = None if body is None else json.dumps(body).replace("{caller}", caller)
            response = clients[caller].generic(
                method, path, data=data, content_type="application/json"
            )
            expected = allowed.get(caller, 401 if caller == "anonymous" else 403)
            if response.status_code != expected:
                failures.append(
                    f"{method} {path} as {caller}: expected {expected}, "
                    f"got {response.status_code} {response.content[:120]!r}"
                )
    assert not failures, "\n".join(failures)
