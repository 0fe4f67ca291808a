"""A request's SLO class (docs/slo-classes.md): which one it asks for, and whether its
tenant may use it.

A client picks its class with OpenAI's ``service_tier`` field or the ``X-Syshax-Class``
header (the header wins):

==================================  ==========================
``service_tier``                    class
==================================  ==========================
``"priority"``                      ``interactive``
``"default"``, ``"auto"``, absent   the tenant's default class
``"flex"``                          ``batch``
==================================  ==========================

Anything else is a 400 naming the field; a class the tenant may not use is a 403. The
engines never see ``service_tier`` (vLLM does not know it) nor a client's own ``priority``
(the class sets that, where the deployment's engines schedule by priority).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.policy_schema import SLO_CLASSES
from common.tenants import TenantRecord
from router.client.errors import RouterError, bad_request

CLASS_HEADER = "X-Syshax-Class"
SERVICE_TIER = "service_tier"
# The engine request's field for vLLM's --scheduling-policy priority (lower is first).
PRIORITY = "priority"
# OpenAI's service tiers and the class each stands for; None: the tenant's default class.
TIERS: dict[str, str | None] = {
    "priority": "interactive",
    "default": None,
    "auto": None,
    "flex": "batch",
}


def requested_class(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The class a request asks for by its header or its ``service_tier``; None: the
    tenant's default. A 400 naming the header or the field for anything unknown."""
    tier = body.get(SERVICE_TIER)
    from_tier: str | None = None
    if tier is not None:
        if not isinstance(tier, str) or tier not in TIERS:
            raise bad_request(
                f"'{SERVICE_TIER}' must be one of {', '.join(TIERS)}; got {tier!r}",
                param=SERVICE_TIER,
                code="invalid_service_tier",
            )
        from_tier = TIERS[tier]
    header = headers.get(CLASS_HEADER)
    if header is None:
        return from_tier
    name = header.strip().lower()
    if name not in SLO_CLASSES:
        raise bad_request(
            f"{CLASS_HEADER} must be one of {', '.join(SLO_CLASSES)}; got {header!r}",
            param=CLASS_HEADER,
            code="invalid_class",
        )
    return name


def choose_class(tenant: TenantRecord, body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """The request's class: what it asks for, else its tenant's default; a 403
    ``class_not_allowed`` when the tenant may not use it."""
    name = requested_class(body, headers) or tenant.default_class
    if not tenant.allows_class(name):
        raise RouterError(
            403,
            f"tenant {tenant.name!r} may not use the SLO class {name!r} "
            f"(allowed: {', '.join(tenant.classes)})",
            type_="permission_error",
            param=CLASS_HEADER if headers.get(CLASS_HEADER) is not None else SERVICE_TIER,
            code="class_not_allowed",
        )
    return name


def strip_class_fields(body: dict[str, Any]) -> bool:
    """Removes ``service_tier`` and a client's own ``priority`` from ``body`` (the router
    sets the engine's priority from the class); returns whether the body changed."""
    changed = False
    for key in (SERVICE_TIER, PRIORITY):
        if key in body:
            del body[key]
            changed = True
    return changed


def with_priority(raw: bytes, priority: int) -> bytes:
    """``raw`` (a JSON object without a ``priority`` field) with ``"priority": n`` added,
    without encoding the body again."""
    end = raw.rstrip()
    if not end.endswith(b"}"):
        raise ValueError("not a JSON object")
    head = end[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + b'"priority":%d}' % priority
