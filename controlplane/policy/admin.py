from __future__ import annotations

from django.contrib import admin, messages

from controlplane.core.actors import Actor
from controlplane.core.admin import ServiceDeleteAdmin
from controlplane.policy import services
from controlplane.policy.models import KNOB_NAMES, PolicyRevision, SchedulingPolicy


class PolicyRevisionInline(admin.TabularInline):  # type: ignore[type-arg]
    model = PolicyRevision
    extra = 0
    can_delete = False
    readonly_fields = fields = (
        "version",
        "changed",
        "reason",
        "created_by",
        "created_by_label",
        "created_at",
        "rolled_back_to",
    )

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(SchedulingPolicy)
class SchedulingPolicyAdmin(ServiceDeleteAdmin):
    list_display = [
        "name",
        "version",
        "mode",
        "algorithm",
        "enable_auto_pd_offload",
        "cpu_max_batch_size",
        "updated_at",
    ]
    list_filter = ["mode", "algorithm"]
    search_fields = ["name"]
    readonly_fields = ["version"]

    def delete_refusal(self, obj: SchedulingPolicy) -> str:
        return services.policy_delete_refusal(obj)

    def delete_with(self, obj: SchedulingPolicy, *, acting_user: Actor) -> None:
        services.delete_policy(obj, acting_user=acting_user)

    inlines = [PolicyRevisionInline]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        # Route admin edits through the service so they become revisions like any other change.
        if not change:
            # The admin form has already validated every knob, so save it as built and record
            # the first revision (and an audit row) the same way services.create_policy does.
            super().save_model(request, obj, form, change)
            services.record_created(obj, acting_user=request.user, reason="created in the admin")
            return
        changes = {k: form.cleaned_data[k] for k in KNOB_NAMES if k in form.changed_data}
        if "description" in form.changed_data:
            SchedulingPolicy.objects.filter(pk=obj.pk).update(description=obj.description)
        if changes:
            original = SchedulingPolicy.objects.get(pk=obj.pk)
            services.update_policy(
                original, changes=changes, acting_user=request.user, reason="edited in the admin"
            )
            obj.refresh_from_db()
            messages.info(request, f"policy {obj.name} is now version {obj.version}")


@admin.register(PolicyRevision)
class PolicyRevisionAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["policy", "version", "reason", "created_by", "created_at", "rolled_back_to"]
    list_filter = ["policy"]
    search_fields = ["reason"]
    readonly_fields = [f.name for f in PolicyRevision._meta.fields]
    actions = ["rollback"]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    @admin.action(description="Roll the policy back to the selected revision")
    def rollback(self, request, queryset):  # type: ignore[no-untyped-def]
        if queryset.count() != 1:
            self.message_user(request, "select exactly one revision", level=messages.ERROR)
            return
        revision = queryset.get()
        services.rollback_policy(
            revision.policy, to_version=revision.version, acting_user=request.user
        )
        self.message_user(request, f"{revision.policy.name} rolled back to v{revision.version}")
