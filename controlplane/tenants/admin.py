from __future__ import annotations

from django.contrib import admin, messages

from controlplane.core.actors import Actor
from controlplane.core.admin import RecordAdmin, ServiceDeleteAdmin
from controlplane.tenants import services
from controlplane.tenants.models import Tenant, TenantKey, TenantUsage

SHOWN_ONCE = "copy it now; it is not stored"


class TenantKeyInline(admin.TabularInline):  # type: ignore[type-arg]
    """A tenant's keys, read-only: they are issued (Tenant keys, Add) and revoked (the
    action there), never edited."""

    model = TenantKey
    extra = 0
    can_delete = False
    readonly_fields = fields = ("prefix", "label", "created_at", "created_by", "revoked_at")

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(Tenant)
class TenantAdmin(ServiceDeleteAdmin):
    list_display = [
        "name",
        "active",
        "rpm_limit",
        "tpm_limit",
        "classes",
        "default_class",
        "updated_at",
    ]
    list_filter = ["active", "default_class"]
    search_fields = ["name", "description"]
    inlines = [TenantKeyInline]
    actions = ["issue_key"]

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        # Routers, metrics and usage know a tenant by name: it does not change.
        return ["name"] if obj is not None else []

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        # The form ran the model's rules already; the service saves and audits.
        values = {name: getattr(obj, name) for name in services.TENANT_FIELDS}
        original = Tenant.objects.get(pk=obj.pk) if change else None
        if original is not None:
            values = {k: v for k, v in values.items() if k in form.changed_data}
        saved = services.save_tenant(original, values, acting_user=request.user)
        obj.pk = saved.pk
        obj.created_at, obj.updated_at = saved.created_at, saved.updated_at

    def delete_refusal(self, obj: Tenant) -> str:
        return services.tenant_delete_refusal(obj)

    def delete_with(self, obj: Tenant, *, acting_user: Actor) -> None:
        services.delete_tenant(obj, acting_user=acting_user)

    @admin.action(description="Issue a key for each selected tenant", permissions=["add_key"])
    def issue_key(self, request, queryset):  # type: ignore[no-untyped-def]
        for tenant in queryset:
            _key, plaintext = services.issue_key(
                tenant, "issued in the admin", acting_user=request.user
            )
            messages.warning(request, f"Key for tenant {tenant.name}: {plaintext} — {SHOWN_ONCE}.")

    def has_add_key_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return bool(request.user.has_perm("tenants.add_tenantkey"))


@admin.register(TenantKey)
class TenantKeyAdmin(RecordAdmin):
    """Keys are issued here (the key appears once, in the message after Save) and revoked with
    the action; a revoked key stays as the record of who had access."""

    list_display = ["tenant", "prefix", "label", "created_at", "created_by", "revoked_at"]
    list_filter = ["revoked_at", "tenant"]
    search_fields = ["tenant__name", "prefix", "label"]
    fields = ["tenant", "label", "prefix", "created_at", "created_by", "revoked_at"]
    actions = ["revoke"]

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        fixed = ["tenant", "label"] if obj is not None else []
        return [*fixed, "prefix", "created_at", "created_by", "revoked_at"]

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return obj is None and super().has_change_permission(request, obj)

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        if change:  # nothing of a key changes but its revocation, which is the action's
            return
        key, plaintext = services.issue_key(obj.tenant, obj.label, acting_user=request.user)
        obj.pk, obj.prefix, obj.created_at = key.pk, key.prefix, key.created_at
        messages.warning(request, f"Key for tenant {obj.tenant.name}: {plaintext} — {SHOWN_ONCE}.")

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request, queryset):  # type: ignore[no-untyped-def]
        revoked = sum(
            services.revoke_key(key, acting_user=request.user)
            for key in queryset.filter(revoked_at__isnull=True).select_related("tenant")
        )
        self.message_user(request, f"{revoked} key(s) revoked")


@admin.register(TenantUsage)
class TenantUsageAdmin(RecordAdmin):
    list_display = [
        "minute",
        "tenant",
        "router",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "rejected",
    ]
    list_filter = ["tenant", "router"]
    date_hierarchy = "minute"
    readonly_fields = [f.name for f in TenantUsage._meta.fields]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False
