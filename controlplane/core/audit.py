from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.db import models

from controlplane.core.actors import Actor
from controlplane.core.models import AuditEntry

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def split_actor(acting_user: Actor) -> tuple[User | None, str]:
    """Split ``acting_user`` into (Django user, "") or (None, machine label).

    ``acting_user`` may be a Django user, a machine principal, a plain label or None
    (an action the system took on its own, labelled "system").
    """
    if getattr(acting_user, "_meta", None) is not None:
        return cast("User", acting_user), ""
    return None, str(acting_user or "system")


def record(
    action: models.TextChoices,
    obj: models.Model,
    *,
    acting_user: Actor = None,
    detail: dict[str, Any] | None = None,
) -> AuditEntry:
    """Write one audit row. ``action`` is a member of its app's ``*AuditAction`` enumeration
    (``choices.py``), stored as its string value; ``acting_user`` is an :data:`Actor`."""
    user, label = split_actor(acting_user)
    return AuditEntry.objects.create(
        actor=user,
        actor_label=label,
        action=action,
        object_type=obj._meta.label_lower,
        object_id=str(obj.pk),
        detail=detail or {},
    )
