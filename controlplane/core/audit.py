from __future__ import annotations

from typing import Any

from django.db import models

from controlplane.core.models import AuditEntry


def record(
    action: str, obj: models.Model, *, acting_user: Any = None, detail: dict[str, Any] | None = None
) -> AuditEntry:
    """Write one audit row. ``acting_user`` may be a Django user, a machine principal or None."""
    user = acting_user if getattr(acting_user, "_meta", None) is not None else None
    label = "" if user is not None else str(acting_user or "system")
    return AuditEntry.objects.create(
        actor=user,
        actor_label=label,
        action=action,
        object_type=obj._meta.label_lower,
        object_id=str(obj.pk),
        detail=detail or {},
    )
