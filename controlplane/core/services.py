"""Deletes, as every app's delete service makes them.

A delete service (``delete_deployment``, ``delete_profile``, ``delete_node`` ...) lives in its
app's services module and is the one way its rows go: the API's ``perform_destroy``, the
admin (its object page and its bulk action, :class:`controlplane.core.admin.ServiceDeleteAdmin`)
and the dashboard all call it. It checks the model's rules once, under a lock, raises
:class:`DeleteRefused` naming what forbids the delete, and deletes with :func:`audited_delete`,
which writes the audit row in the same transaction. What still refers to the row through a
protected key (a profile's deployments) refuses it as Django's ``ProtectedError``, which the
API answers as a 409 naming the users and the admin as its "cannot delete" page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.db import models, transaction

from controlplane.core import audit
from controlplane.core.actors import Actor
from controlplane.core.api import Conflict

M = TypeVar("M", bound=models.Model)


class DeleteRefused(Conflict):
    """409: the object's rules forbid deleting it now; the message says why and what to do.
    The API answers it in the error shape; the admin shows the message and deletes nothing."""

    default_code = "conflict"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def audited_delete(
    obj: models.Model,
    action: models.TextChoices,
    *,
    acting_user: Actor,
    detail: dict[str, Any] | None = None,
) -> None:
    """Delete ``obj`` and write its audit row (``action``, with its name and ``detail``), both
    or neither. A ``ProtectedError`` leaves no row behind."""
    with transaction.atomic():
        audit.record(
            action, obj, acting_user=acting_user, detail={"name": str(obj), **(detail or {})}
        )
        obj.delete()


def checked_delete(
    obj: M,
    refusal: Callable[[M], str],
    action: models.TextChoices,
    *,
    acting_user: Actor,
    detail: Callable[[M], dict[str, Any]] | None = None,
) -> None:
    """Lock ``obj``'s row, ask ``refusal`` (why it may not go, or "") and raise DeleteRefused
    with its answer, or delete it with :func:`audited_delete`. A row gone meanwhile is done."""
    with transaction.atomic():
        manager = type(obj)._default_manager
        locked = manager.select_for_update().filter(pk=obj.pk).first()
        if locked is None:
            return
        why = refusal(locked)
        if why:
            raise DeleteRefused(why)
        audited_delete(
            locked, action, acting_user=acting_user, detail=detail(locked) if detail else None
        )
