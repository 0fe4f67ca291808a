from __future__ import annotations

from django.contrib import admin, messages

from controlplane.access.models import MachineCredential


@admin.register(MachineCredential)
class MachineCredentialAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["name", "kind", "node", "key_hint", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["kind", "revoked_at"]
    search_fields = ["name", "node__name", "key_hint"]
    fields = ["kind", "name", "node", "key_hint", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["key_hint", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        if change:
            super().save_model(request, obj, form, change)
            return
        credential, token = MachineCredential.issue(
            obj.kind, obj.name, node=obj.node, created_by=request.user
        )
        obj.pk = credential.pk
        obj.key_hint = credential.key_hint
        messages.warning(
            request, f"Token for {credential}: {token} — copy it now; it is not stored."
        )

    @admin.action(description="Revoke selected credentials")
    def revoke(self, request, queryset):  # type: ignore[no-untyped-def]
        for credential in queryset.filter(revoked_at__isnull=True):
            credential.revoke()
