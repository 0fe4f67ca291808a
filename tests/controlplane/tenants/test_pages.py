"""The tenants' dashboard pages and admin, through Django's test client."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from common.tenants import hash_key
from controlplane.tenants import services
from controlplane.tenants.models import Tenant, TenantKey
from controlplane.tenants.usage import record_usage


def login(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator(db) -> Client:
    user = User.objects.create_user("tenant-op", password="x-unused-x")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="tenants"))
    return login(user)


@pytest.fixture
def viewer(db) -> Client:
    return login(User.objects.create_user("viewer", password="x-unused-x"))


@pytest.fixture
def browser(admin_user) -> Client:
    return login(admin_user)


def test_the_list_shows_limits_keys_and_last_hours_usage(operator, tenant, router_instance) -> None:
    services.issue_key(tenant, acting_user="test")
    record_usage(
        router_instance,
        {
            "tenants": {
                "acme": {
                    "requests": 7,
                    "prompt_tokens": 40,
                    "completion_tokens": 2,
                    "rejected": {"rpm": 3},
                }
            }
        },
    )
    page = operator.get("/tenants/")
    assert page.status_code == 200
    text = page.content.decode()
    assert 'href="/tenants/acme/"' in text and 'aria-current="page">Tenants' in text
    rows = page.context["rows"]
    assert [(t.name, t.active_key_count, u.requests, u.tokens, u.rejections) for t, u in rows] == [
        ("acme", 1, 7, 42, 3)
    ]
    assert "rpm 3" in text and "New tenant" in text


def test_a_new_tenant_form_shows_every_error_at_once(operator) -> None:
    page = operator.post(
        "/tenants/",
        {
            "name": "Bad Name",
            "rpm_limit": "x",
            "tpm_limit": "0",
            "default_class": "batch",
            "classes": ["standard"],
        },
    )
    assert page.status_code == 400
    form = page.context["form"]
    assert set(form.errors) == {"name", "rpm_limit", "default_class"}
    assert "fix 3 problems" in page.content.decode()
    assert not Tenant.objects.exists()


def test_a_tenant_is_created_and_changed_from_the_pages(operator) -> None:
    created = operator.post(
        "/tenants/",
        {
            "name": "team-b",
            "active": "on",
            "rpm_limit": "30",
            "tpm_limit": "0",
            "models": "qwen\n\nllama\n",
            "classes": ["standard", "batch"],
            "default_class": "standard",
        },
    )
    assert created.status_code == 302 and created["Location"] == "/tenants/team-b/"
    tenant = Tenant.objects.get()
    assert (tenant.rpm_limit, tenant.models, tenant.classes) == (
        30,
        ["qwen", "llama"],
        ["standard", "batch"],
    )
    changed = operator.post(
        "/tenants/team-b/",
        {"rpm_limit": "0", "tpm_limit": "500", "classes": ["batch"], "default_class": "batch"},
    )
    assert changed.status_code == 302
    tenant.refresh_from_db()
    assert (tenant.active, tenant.tpm_limit, tenant.classes) == (False, 500, ["batch"])
    refused = operator.post(
        "/tenants/team-b/",
        {"rpm_limit": "-1", "tpm_limit": "0", "classes": ["batch"], "default_class": "standard"},
    )
    assert refused.status_code == 400
    assert set(refused.context["form"].errors) == {"rpm_limit", "default_class"}


def test_a_key_is_shown_once_on_the_page_and_revoked_there(operator, tenant) -> None:
    issued = operator.post("/tenants/acme/keys/", {"label": "eval jobs"})
    assert issued.status_code == 200
    assert issued["Cache-Control"] == "no-store"
    key, plaintext = issued.context["new_key"]
    assert key.key_hash == hash_key(plaintext) and plaintext in issued.content.decode()
    again = operator.get("/tenants/acme/")
    assert plaintext not in again.content.decode() and key.prefix in again.content.decode()
    revoked = operator.post(f"/tenants/acme/keys/{key.pk}/revoke/")
    assert revoked.status_code == 302
    assert TenantKey.objects.get().revoked_at is not None


def test_the_usage_charts_follow_the_window(operator, tenant, router_instance) -> None:
    record_usage(router_instance, {"tenants": {"acme": {"requests": 12, "rejected": {"shed": 2}}}})
    for window, points in (("5m", 5), ("1h", 12), ("24h", 24)):
        page = operator.get(f"/tenants/acme/?window={window}")
        assert page.status_code == 200
        assert len(page.context["buckets"]) == points
        assert page.context["totals"].requests == 12
        assert "<svg" in str(page.context["requests_chart"])
        assert page.context["reasons"] == ["shed"]
    assert operator.get("/tenants/acme/?window=7d").context["window"] == "1h"


def test_a_viewer_reads_but_may_not_act(viewer, tenant) -> None:
    page = viewer.get("/tenants/acme/")
    assert page.status_code == 200
    assert "may read this tenant but not change it" in page.content.decode()
    assert "Issue key" not in page.content.decode()
    assert viewer.post("/tenants/acme/keys/", {"label": "x"}).status_code == 403
    assert viewer.post("/tenants/", {"name": "x"}).status_code == 403
    assert viewer.post("/tenants/acme/delete/").status_code == 403
    assert viewer.get("/tenants/nobody/").status_code == 404


def test_the_page_deletes_the_tenant(operator, tenant) -> None:
    response = operator.post("/tenants/acme/delete/")
    assert response.status_code == 302 and not Tenant.objects.exists()


def test_the_admin_issues_a_key_in_a_message_and_revokes_with_an_action(browser, tenant) -> None:
    response = browser.post(
        "/admin/tenants/tenantkey/add/", {"tenant": tenant.pk, "label": "from admin"}, follow=True
    )
    assert response.status_code == 200
    key = TenantKey.objects.get()
    shown = [str(m) for m in response.context["messages"]]
    assert any(key.prefix in m and "not stored" in m for m in shown), shown
    assert key.label == "from admin"
    changelist = "/admin/tenants/tenantkey/"
    browser.post(changelist, {"action": "revoke", "_selected_action": [key.pk]})
    assert TenantKey.objects.get().revoked_at is not None
    page = browser.get(f"/admin/tenants/tenant/{tenant.pk}/change/")
    assert page.status_code == 200 and key.prefix in page.content.decode()
    browser.post("/admin/tenants/tenant/", {"action": "issue_key", "_selected_action": [tenant.pk]})
    assert TenantKey.objects.count() == 2


def test_the_admin_saves_through_the_service_and_refuses_bad_values(browser) -> None:
    form = {
        "name": "adm",
        "description": "",
        "active": "on",
        "rpm_limit": "5",
        "tpm_limit": "0",
        "models": "[]",
        "classes": '["batch"]',
        "default_class": "standard",
        "keys-TOTAL_FORMS": "0",
        "keys-INITIAL_FORMS": "0",
    }
    refused = browser.post("/admin/tenants/tenant/add/", form)
    assert refused.status_code == 200 and not Tenant.objects.exists()
    assert "default_class" in refused.context["adminform"].form.errors
    saved = browser.post("/admin/tenants/tenant/add/", {**form, "default_class": "batch"})
    assert saved.status_code == 302, saved.context["adminform"].form.errors
    assert Tenant.objects.get().classes == ["batch"]


def test_usage_rows_are_a_record_in_the_admin(browser, tenant, router_instance) -> None:
    record_usage(router_instance, {"tenants": {"acme": {"requests": 1}}})
    assert browser.get("/admin/tenants/tenantusage/").status_code == 200
    assert browser.get("/admin/tenants/tenantusage/add/").status_code == 403
    row = tenant.usage.get()
    assert browser.get(f"/admin/tenants/tenantusage/{row.pk}/delete/").status_code == 403
    assert row.minute <= timezone.now() < row.minute + timedelta(minutes=1)
