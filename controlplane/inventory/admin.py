from __future__ import annotations

from django.contrib import admin

from controlplane.core.actors import Actor
from controlplane.core.admin import RecordAdmin, ServiceDeleteAdmin
from controlplane.inventory import services
from controlplane.inventory.models import Accelerator, CpuTopology, Heartbeat, Node, NumaNode


class CpuTopologyInline(admin.StackedInline):  # type: ignore[type-arg]
    model = CpuTopology
    extra = 0
    can_delete = False


class NumaNodeInline(admin.TabularInline):  # type: ignore[type-arg]
    model = NumaNode
    extra = 0
    fields = ["index", "cpus", "memory_total_bytes"]


class AcceleratorInline(admin.TabularInline):  # type: ignore[type-arg]
    model = Accelerator
    extra = 0
    # A card is deleted on its own page, through its delete service (a claimed one is kept).
    can_delete = False
    fields = [
        "index",
        "kind",
        "vendor",
        "model_name",
        "uuid",
        "memory_total_bytes",
        "utilization_percent",
        "temperature_c",
        "simulated",
    ]
    readonly_fields = ["utilization_percent", "temperature_c"]


@admin.register(Node)
class NodeAdmin(ServiceDeleteAdmin):
    list_display = ["name", "status", "address", "last_heartbeat_at", "agent_version"]
    list_filter = ["status", "accelerators__kind", "accelerators__simulated"]
    search_fields = ["name", "address", "hostname"]
    # The status moves by heartbeats, the reaper and the two actions below (NODE_LIFECYCLE),
    # never by editing the field.
    readonly_fields = ["status", "last_heartbeat_at", "inventory_hash", "inventory_updated_at"]
    inlines = [CpuTopologyInline, NumaNodeInline, AcceleratorInline]
    actions = ["drain", "undrain"]

    def delete_refusal(self, obj: Node) -> str:
        return services.node_delete_refusal(obj)

    def delete_with(self, obj: Node, *, acting_user: Actor) -> None:
        services.delete_node(obj, acting_user=acting_user)

    @admin.action(description="Drain selected nodes (no new deployments)")
    def drain(self, request, queryset):  # type: ignore[no-untyped-def]
        queryset.update(status="draining")

    @admin.action(description="Stop draining (online when heartbeating)")
    def undrain(self, request, queryset):  # type: ignore[no-untyped-def]
        queryset.filter(status="draining").update(status="offline")


@admin.register(Accelerator)
class AcceleratorAdmin(ServiceDeleteAdmin):
    list_display = [
        "node",
        "index",
        "kind",
        "model_name",
        "memory_total_bytes",
        "utilization_percent",
        "temperature_c",
        "simulated",
    ]
    list_filter = ["kind", "vendor", "simulated"]
    search_fields = ["model_name", "uuid", "node__name"]

    def delete_refusal(self, obj: Accelerator) -> str:
        return services.accelerator_delete_refusal(obj)

    def delete_with(self, obj: Accelerator, *, acting_user: Actor) -> None:
        services.delete_accelerator(obj, acting_user=acting_user)


@admin.register(Heartbeat)
class HeartbeatAdmin(RecordAdmin):
    list_display = ["node", "received_at", "cpu_percent", "memory_used_bytes"]
    list_filter = ["node"]
    date_hierarchy = "received_at"
