"""Who calls the Batch API: a tenant with its own key, or a router for its own callers.

- ``Authorization: Bearer sk-shx-...``: a tenant's key (``tenants.services.tenant_for_key``).
  A router forwards a tenant's request with the tenant's own key;
- ``Authorization: Bearer sxr_...`` with ``X-Syshax-Tenant: <name>``: a router forwarding a
  request of its own callers, which own batches without being tenants (``router-key`` for
  the router's own API key, ``anonymous`` on an open router). A router token naming a real
  tenant is refused: any router credential would otherwise act as every tenant
  (docs/decisions/0057-router-credential-scope-and-usage-bounds.md).

The caller's ``owner`` scopes every lookup: another owner's file or batch is a 404.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.http import HttpRequest

from common.tenants import KEY_PREFIX
from controlplane.access.authentication import active_machine_credentials
from controlplane.access.choices import CredentialKind
from controlplane.batches.shapes import BatchApiError
from controlplane.tenants.choices import RESERVED_NAMES
from controlplane.tenants.models import Tenant
from controlplane.tenants.services import tenant_for_key

TENANT_HEADER = "X-Syshax-Tenant"
ROUTER_TOKEN_PREFIX = "sxr_"


@dataclass(frozen=True)
class Caller:
    owner: str
    tenant: Tenant | None


def allows_model(tenant: Tenant | None, model: str) -> bool:
    """Whether ``tenant`` may use ``model``; the routers' own callers may use every model."""
    return tenant is None or not tenant.models or model in tenant.models


def _unauthorized(message: str) -> BatchApiError:
    return BatchApiError(401, message, code="invalid_api_key")


def authenticate(request: HttpRequest) -> Caller:
    parts = request.headers.get("Authorization", "").split()
    if len(parts) != 2 or parts[0] != "Bearer":
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
    token = parts[1]
    named = request.headers.get(TENANT_HEADER, "").strip()
    if token.startswith(ROUTER_TOKEN_PREFIX):
        return _for_router(token, named)
    if token.startswith(KEY_PREFIX):
        tenant = tenant_for_key(token)
        if tenant is None:
            raise _unauthorized("Incorrect API key, or one revoked, or its tenant inactive")
        if named and named != tenant.name:
            raise BatchApiError(
                403,
                f"{TENANT_HEADER} is for routers; a tenant's key acts as its own tenant",
                code="tenant_header_not_allowed",
                param=TENANT_HEADER,
            )
        return Caller(tenant.name, tenant)
    raise _unauthorized("Incorrect API key")


def _for_router(token: str, named: str) -> Caller:
    credential = active_machine_credentials([token]).get(token)
    if credential is None or credential.kind != CredentialKind.ROUTER:
        raise _unauthorized("Incorrect API key")
    if not named:
        raise BatchApiError(
            400,
            f"a router forwards the Batch API with {TENANT_HEADER}: <tenant>",
            code="missing_tenant",
            param=TENANT_HEADER,
        )
    if named in RESERVED_NAMES:
        return Caller(named, None)
    raise BatchApiError(
        403,
        f"a router token acts only for the router's own callers ({', '.join(RESERVED_NAMES)}); "
        f"a tenant's requests carry its own key, not {TENANT_HEADER}: {named!r}",
        code="tenant_needs_own_key",
        param=TENANT_HEADER,
    )
