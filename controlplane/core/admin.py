from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import models

from controlplane.core.actors import Actor
from controlplane.core.models import AuditEntry
from controlplane.core.services import DeleteRefused


class ServiceDeleteAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """An admin whose deletes go through its app's delete service (controlplane/core/services.py).

    The confirmation page, for one object or the bulk action, lists what the service's rules
    refuse the way Django lists protected objects: the page says "Cannot delete", and posting
    it deletes nothing. A confirmed delete calls the service, which checks again under its lock
    and writes the audit row. Subclasses name the service in :meth:`delete_with` and its rules
    in :meth:`delete_refusal`.
    """

    def delete_refusal(self, obj: Any) -> str:
        """Why ``obj`` may not be deleted now; "" when it may (protected keys aside: Django
        lists what they protect)."""
        return ""

    def delete_with(self, obj: Any, *, acting_user: Actor) -> None:
        """The app's delete service for ``obj``."""
        raise NotImplementedError

    def get_deleted_objects(self, objs, request):  # type: ignore[no-untyped-def]
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        refusals = [why for why in map(self.delete_refusal, objs) if why]
        return deleted, counts, perms_needed, [*protected, *refusals]

    def _delete_one(self, request: Any, obj: models.Model) -> None:
        try:
            self.delete_with(obj, acting_user=request.user)
        except DeleteRefused as exc:  # its state changed since the confirmation page
            self.message_user(request, f"{obj}: {exc}", level=messages.ERROR)

    def delete_model(self, request, obj):  # type: ignore[no-untyped-def]
        self._delete_one(request, obj)

    def delete_queryset(self, request, queryset):  # type: ignore[no-untyped-def]
        for obj in queryset:
            self._delete_one(request, obj)


class RecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Rows the system writes as its record (audit rows, deployment events, agent commands,
    containers, heartbeats, benchmark samples) or that are retired rather than removed
    (credentials and tokens: revoke them). An operator reads them and never deletes one by
    hand: no delete button, no bulk delete, and the delete page answers 403. Deleting what
    they belong to (a stopped deployment, a node) still takes them along, through that
    object's delete service."""

    def get_actions(self, request):  # type: ignore[no-untyped-def]
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def change_view(self, request, object_id, form_url="", extra_context=None):  # type: ignore[no-untyped-def]
        return super().change_view(
            request, object_id, form_url, {**(extra_context or {}), "show_delete": False}
        )

    def delete_view(self, request, object_id, extra_context=None):  # type: ignore[no-untyped-def]
        raise PermissionDenied(f"{self.opts.verbose_name_plural} are not deleted by hand")


@admin.register(AuditEntry)
class AuditEntryAdmin(RecordAdmin):
    list_display = ["created_at", "action", "object_type", "object_id", "actor", "actor_label"]
    list_filter = ["action", "object_type"]
    search_fields = ["object_id", "actor_label"]
    readonly_fields = [f.name for f in AuditEntry._meta.fields]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False
