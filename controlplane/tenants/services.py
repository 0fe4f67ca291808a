"""Tenants and their keys: created, changed, issued, revoked and deleted here, each atomic and
audited; and what routers read of them (docs/tenants.md).

The API, the admin and the dashboard all go through these functions. A key's plaintext
exists only in :func:`issue_key`'s answer: the row keeps its SHA-256 and its first characters.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from common.errors import FieldError
from common.tenants import TenantError, hash_key, new_key, parse_tenant
from controlplane.core import audit
from controlplane.core.actors import Actor
from controlplane.core.services import checked_delete
from controlplane.tenants.choices import TenantAuditAction
from controlplane.tenants.models import Tenant, TenantKey

log = logging.getLogger(__name__)

# What a tenant's create or change may set.
TENANT_FIELDS = (
    "name",
    "description",
    "active",
    "rpm_limit",
    "tpm_limit",
    "models",
    "classes",
    "default_class",
)
# How many of a key's first characters its row keeps, to tell keys apart: the "sk-shx-"
# prefix and five random characters (30 bits: a hint, not a way back to the key).
KEY_PREFIX_LENGTH = 12


def _draft(tenant: Tenant | None, values: dict[str, Any]) -> Tenant:
    """A copy of ``tenant`` (a new one when None) with ``values`` set, for judging."""
    draft = Tenant() if tenant is None else Tenant.objects.get(pk=tenant.pk)
    for field, value in values.items():
        setattr(draft, field, value)
    return draft


def tenant_errors(tenant: Tenant | None, values: dict[str, Any]) -> dict[str, list[str]]:
    """Every reason :func:`save_tenant` would refuse ``values``, by field (empty: it would
    save them): each field's limits, the tenant's rules (``Tenant.clean``), a name taken, and
    a change of name."""
    unknown = sorted(set(values) - set(TENANT_FIELDS))
    if unknown:
        return {name: ["not a tenant setting"] for name in unknown}
    errors: dict[str, list[str]] = {}
    if tenant is not None and "name" in values and values["name"] != tenant.name:
        errors["name"] = [
            "a tenant's name does not change (routers, metrics and usage know it by name); "
            "create a new tenant instead"
        ]
        values = {k: v for k, v in values.items() if k != "name"}
    try:
        _draft(tenant, values).full_clean()
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            errors.setdefault(field, []).extend(messages)
    return errors


def save_tenant(tenant: Tenant | None, values: dict[str, Any], *, acting_user: Actor) -> Tenant:
    """Create a tenant from ``values`` (``tenant`` None) or change ``tenant`` to them, with
    an audit row naming the fields that changed. Raises Django's ValidationError holding every
    error at once, each under its field (the API answers it as a 400 naming them all)."""
    errors = tenant_errors(tenant, values)
    if errors:
        raise ValidationError(errors)
    created = tenant is None
    with transaction.atomic():
        if tenant is None:
            target = _draft(None, values)
            changed = sorted(values)
        else:
            target = Tenant.objects.select_for_update().get(pk=tenant.pk)
            changed = sorted(k for k, v in values.items() if getattr(target, k) != v)
            for field, value in values.items():
                setattr(target, field, value)
        target.save()
        audit.record(
            TenantAuditAction.TENANT_CREATED if created else TenantAuditAction.TENANT_UPDATED,
            target,
            acting_user=acting_user,
            detail={"name": target.name, "fields": changed},
        )
    if tenant is not None:
        tenant.refresh_from_db()
    return target


def tenant_delete_refusal(tenant: Tenant) -> str:
    """Why the tenant may not be deleted now, or "". Nothing refuses it today: its keys stop
    working at every router's next poll, and its usage goes with it."""
    return ""


def delete_tenant(tenant: Tenant, *, acting_user: Actor) -> None:
    """Delete the tenant with its keys and usage, and an audit row."""
    checked_delete(
        tenant,
        tenant_delete_refusal,
        TenantAuditAction.TENANT_DELETED,
        acting_user=acting_user,
        detail=lambda t: {"keys": t.keys.count()},
    )


def issue_key(tenant: Tenant, label: str = "", *, acting_user: Actor) -> tuple[TenantKey, str]:
    """A new key for ``tenant``: the row (its hash and prefix) and the key itself, which is
    shown once and never stored."""
    label = label.strip()
    limit = TenantKey._meta.get_field("label").max_length or 0
    if len(label) > limit:
        raise FieldError("label", f"at most {limit} characters; got {len(label)}")
    user, by_label = audit.split_actor(acting_user)
    plaintext = new_key()
    with transaction.atomic():
        key = TenantKey.objects.create(
            tenant=tenant,
            key_hash=hash_key(plaintext),
            prefix=plaintext[:KEY_PREFIX_LENGTH],
            label=label,
            created_by=user,
            created_by_label=by_label if user is None else "",
        )
        audit.record(
            TenantAuditAction.KEY_ISSUED,
            tenant,
            acting_user=acting_user,
            detail={"key": key.pk, "prefix": key.prefix, "label": label},
        )
    return key, plaintext


def revoke_key(key: TenantKey, *, acting_user: Actor) -> bool:
    """Revoke ``key`` unless it is revoked already (compare-and-set), with an audit row; True
    if it was revoked now. Routers refuse it from their next poll of ``routing/tenants``."""
    now = timezone.now()
    with transaction.atomic(durable=True):
        changed = TenantKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(
            revoked_at=now
        )
        if changed:
            key.revoked_at = now
            audit.record(
                TenantAuditAction.KEY_REVOKED,
                key.tenant,
                acting_user=acting_user,
                detail={"key": key.pk, "prefix": key.prefix, "label": key.label},
            )
    if not changed:
        key.refresh_from_db(fields=["revoked_at"])
    return bool(changed)


def tenant_for_key(plaintext: str) -> Tenant | None:
    """The active tenant an unrevoked key belongs to, or None."""
    key = (
        TenantKey.objects.select_related("tenant")
        .filter(key_hash=hash_key(plaintext), revoked_at__isnull=True, tenant__active=True)
        .first()
    )
    return key.tenant if key is not None else None


def routing_document() -> dict[str, Any]:
    """``{"tenants": [...]}`` as routers read it (``common.tenants.parse_tenants``): the active
    tenants, each with the hashes of its unrevoked keys. A row the shared parser would refuse
    (saved before a rule it breaks) is left out with a log line rather than make every router
    refuse the whole document."""
    hashes: dict[int, set[str]] = {}
    for tenant_id, key_hash in TenantKey.objects.filter(
        revoked_at__isnull=True, tenant__active=True
    ).values_list("tenant_id", "key_hash"):
        hashes.setdefault(tenant_id, set()).add(key_hash)
    tenants = []
    for tenant in Tenant.objects.filter(active=True).order_by("name"):
        document = tenant.record(frozenset(hashes.get(tenant.pk, ()))).as_document()
        try:
            parse_tenant(document)
        except TenantError as exc:
            log.warning("tenant %s left out of the routers' document: %s", tenant.name, exc)
            continue
        tenants.append(document)
    return {"tenants": tenants}


def routing_etag(document: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:32]
    return f'"tenants-{digest}"'
