from __future__ import annotations

from django.contrib import admin

from controlplane.core.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["created_at", "action", "object_type", "object_id", "actor", "actor_label"]
    list_filter = ["action", "object_type"]
    search_fields = ["object_id", "actor_label"]
    readonly_fields = [f.name for f in AuditEntry._meta.fields]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False
