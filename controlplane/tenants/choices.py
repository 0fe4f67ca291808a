"""The tenants app's fixed vocabularies (docs/tenants.md)."""

from __future__ import annotations

from datetime import timedelta

from django.db import models

from common.tenants import ROUTER_KEY_TENANT

# Why a router refused a tenant's request, as its usage reports count them
# (docs/machine-api.md, "Tenant usage").
REJECT_REASONS = ("rpm", "tpm", "model", "class", "shed", "queue-timeout")

# Names the router gives callers that are not control-plane tenants: its own --api-key and,
# with no key at all, everyone. A tenant may not take one.
RESERVED_NAMES = (ROUTER_KEY_TENANT, "anonymous")

# The usage windows the API and the dashboard offer, by name.
USAGE_WINDOWS = {
    "5m": timedelta(minutes=5),
    "1h": timedelta(hours=1),
    "24h": timedelta(hours=24),
}


class TenantAuditAction(models.TextChoices):
    """The audit rows' actions on tenants and their keys (``AuditEntry.action``)."""

    TENANT_CREATED = "tenant.created"
    TENANT_UPDATED = "tenant.updated"
    TENANT_DELETED = "tenant.deleted"
    KEY_ISSUED = "tenant.key_issued"
    KEY_REVOKED = "tenant.key_revoked"
