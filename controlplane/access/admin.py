from __future__ import annotations

from django.contrib import admin, messages

from controlplane.access.models import MachineCredential, PersonalToken
from controlplane.core.admin import RecordAdmin


@admin.register(MachineCredential)
class MachineCredentialAdmin(RecordAdmin):
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
            credential.revoke(acting_user=request.user)


@admin.register(PersonalToken)
class PersonalTokenAdmin(RecordAdmin):
    """People's API tokens. Only the hint (``sxp_`` and four characters) is ever shown; the
    token itself appears once, in the message after it is added."""

    list_display = ["name", "user", "key_hint", "created_at", "last_used_at", "expires_at"]
    list_display += ["revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "user__username", "key_hint"]
    fields = ["user", "name", "expires_at", "key_hint", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["key_hint", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        tokens = super().get_queryset(request).select_related("user")
        # Anyone else with the model permission sees, and issues, only their own tokens: a
        # token for another person would let them act as that person.
        return tokens if request.user.is_superuser else tokens.filter(user=request.user)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):  # type: ignore[no-untyped-def]
        if db_field.name == "user" and not request.user.is_superuser:
            kwargs["queryset"] = db_field.related_model._default_manager.filter(pk=request.user.pk)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        # A token keeps its owner and expiry; only its name changes.
        fixed = ["user", "expires_at"] if obj is not None else []
        return [*fixed, *self.readonly_fields]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        if change:
            super().save_model(request, obj, form, change)
            return
        token, key = PersonalToken.issue(
            obj.user, obj.name, expires_at=obj.expires_at, acting_user=request.user
        )
        obj.pk, obj.key_hint, obj.created_at = token.pk, token.key_hint, token.created_at
        messages.warning(
            request, f"API token {token} for {obj.user}: {key} — copy it now; it is not stored."
        )

    @admin.action(description="Revoke selected tokens")
    def revoke(self, request, queryset):  # type: ignore[no-untyped-def]
        for token in queryset.filter(revoked_at__isnull=True):
            token.revoke(acting_user=request.user)
