"""Tenants and keys through their services: the rules, the keys' secrecy, what routers read."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from common.errors import FieldError
from common.tenants import KEY_PREFIX, hash_key, parse_tenants
from controlplane.core.models import AuditEntry
from controlplane.tenants import services
from controlplane.tenants.models import Tenant, TenantKey


def test_a_tenant_is_created_with_defaults_and_an_audit_row(make_tenant) -> None:
    tenant = make_tenant("team-a")
    assert (tenant.rpm_limit, tenant.tpm_limit, tenant.models) == (0, 0, [])
    assert (tenant.classes, tenant.default_class) == (
        ["interactive", "standard", "batch"],
        "standard",
    )
    entry = AuditEntry.objects.get(action="tenant.created")
    assert (entry.object_id, entry.actor_label) == (str(tenant.pk), "test")


def test_every_bad_setting_is_named_at_once(db) -> None:
    values = {
        "name": "Not A Slug",
        "rpm_limit": -1,
        "tpm_limit": 2_000_000_000,
        "models": ["ok", " padded"],
        "classes": ["standard", "gold"],
        "default_class": "batch",
    }
    with pytest.raises(ValidationError) as caught:
        services.save_tenant(None, values, acting_user="test")
    errors = caught.value.message_dict
    assert set(errors) == {"name", "rpm_limit", "tpm_limit", "models", "classes"}
    assert "unknown class 'gold'" in errors["classes"][0]
    assert "1000000000" in errors["tpm_limit"][0]
    assert not Tenant.objects.exists()


@pytest.mark.parametrize(
    ("values", "field", "fragment"),
    [
        (
            {"classes": ["standard"], "default_class": "batch"},
            "default_class",
            "one of the tenant's",
        ),
        ({"classes": []}, "classes", "at least one class"),
        ({"classes": ["batch", "batch"], "default_class": "batch"}, "classes", "twice"),
        ({"models": "m1"}, "models", "list of model names"),
        ({"models": ["m", "m"]}, "models", "twice"),
        ({"name": "router-key"}, "name", "routers give their own callers"),
        ({"name": "anonymous"}, "name", "routers give their own callers"),
        ({"colour": "red"}, "colour", "not a tenant setting"),
    ],
)
def test_each_rule_names_its_field(db, values, field, fragment) -> None:
    errors = services.tenant_errors(None, {"name": "t1", **values})
    assert fragment in " ".join(errors[field]), errors


def test_a_taken_name_and_a_renaming_are_refused(tenant) -> None:
    assert "already exists" in services.tenant_errors(None, {"name": "acme"})["name"][0]
    with pytest.raises(ValidationError) as caught:
        services.save_tenant(tenant, {"name": "acme-2", "rpm_limit": 5}, acting_user="test")
    assert "does not change" in caught.value.message_dict["name"][0]
    tenant.refresh_from_db()
    assert (tenant.name, tenant.rpm_limit) == ("acme", 600)


def test_a_change_is_audited_with_the_fields_it_changed(tenant) -> None:
    services.save_tenant(tenant, {"rpm_limit": 60, "tpm_limit": 200_000}, acting_user="test")
    assert tenant.rpm_limit == 60
    entry = AuditEntry.objects.get(action="tenant.updated")
    assert entry.detail == {"name": "acme", "fields": ["rpm_limit"]}


def test_a_key_is_shown_once_and_stored_only_hashed(tenant) -> None:
    key, plaintext = services.issue_key(tenant, "ci", acting_user="test")
    assert plaintext.startswith(KEY_PREFIX) and len(plaintext) > 40
    assert key.key_hash == hash_key(plaintext)
    assert key.prefix == plaintext[:12]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {TenantKey._meta.db_table} WHERE id = %s", [key.pk])
        row = cursor.fetchone()
    assert not any(isinstance(v, str) and plaintext in v for v in row)
    assert not any(plaintext in str(e.detail) for e in AuditEntry.objects.all())
    assert services.tenant_for_key(plaintext) == tenant
    assert services.tenant_for_key(plaintext + "x") is None


def test_a_long_label_is_refused_by_name(tenant) -> None:
    with pytest.raises(FieldError, match="label: at most 100"):
        services.issue_key(tenant, "x" * 101, acting_user="test")


def test_a_revoked_key_or_an_inactive_tenant_leaves_the_routers_document(make_tenant) -> None:
    acme = make_tenant("acme")
    make_tenant("other", classes=["batch"], default_class="batch", models=["m1"])
    kept, kept_plain = services.issue_key(acme, acting_user="test")
    gone, gone_plain = services.issue_key(acme, acting_user="test")
    document = services.routing_document()
    etag = services.routing_etag(document)
    records = {r.name: r for r in parse_tenants(document)}
    assert records["acme"].key_hashes == {kept.key_hash, gone.key_hash}
    assert (records["other"].classes, records["other"].models) == (("batch",), ("m1",))

    assert services.revoke_key(gone, acting_user="test") is True
    assert services.revoke_key(gone, acting_user="test") is False  # once, one audit row
    assert AuditEntry.objects.filter(action="tenant.key_revoked").count() == 1
    document = services.routing_document()
    assert services.routing_etag(document) != etag
    assert parse_tenants(document)[0].key_hashes == {kept.key_hash}
    assert services.tenant_for_key(gone_plain) is None

    services.save_tenant(acme, {"active": False}, acting_user="test")
    assert [r.name for r in parse_tenants(services.routing_document())] == ["other"]
    assert services.tenant_for_key(kept_plain) is None


def test_the_etag_is_stable_while_nothing_changes(tenant) -> None:
    services.issue_key(tenant, acting_user="test")
    first = services.routing_etag(services.routing_document())
    assert services.routing_etag(services.routing_document()) == first


def test_a_row_the_shared_parser_refuses_is_left_out_not_the_whole_document(make_tenant) -> None:
    make_tenant("good")
    bad = make_tenant("bad")
    Tenant.objects.filter(pk=bad.pk).update(classes=["platinum"])  # past the rules
    assert [t["name"] for t in services.routing_document()["tenants"]] == ["good"]


def test_a_tenant_is_deleted_with_its_keys_and_an_audit_row(tenant) -> None:
    services.issue_key(tenant, acting_user="test")
    services.delete_tenant(tenant, acting_user="test")
    assert not Tenant.objects.exists() and not TenantKey.objects.exists()
    entry = AuditEntry.objects.get(action="tenant.deleted")
    assert entry.detail == {"name": "acme", "keys": 1}
