from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from common.errors import FieldError
from controlplane.core.actors import Actor
from controlplane.core.admin import RecordAdmin, ServiceDeleteAdmin
from controlplane.deployments import services
from controlplane.deployments.masking import hide_env, hide_spec_env, may_see_env
from controlplane.deployments.models import (
    AgentCommand,
    ContainerInstance,
    Deployment,
    DeploymentEvent,
    DeploymentProfile,
)
from controlplane.deployments.placement import PlacementError
from controlplane.deployments.render import render_profile


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@admin.register(DeploymentProfile)
class DeploymentProfileAdmin(ServiceDeleteAdmin):
    list_display = [
        "name",
        "model",
        "quantization",
        "engine",
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "cpu_max_num_seqs",
        "pd_protocol",
    ]
    list_filter = ["engine", "quantization", "pd_protocol", "preemption_mode"]
    search_fields = ["name", "model", "served_model_name"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "name",
                    "description",
                    "model",
                    "served_model_name",
                    "quantization",
                    "engine",
                    "pd_protocol",
                    "enable_cpu_engine",
                ]
            },
        ),
        (
            "GPU/NPU engine",
            {
                "fields": [
                    "gpu_image",
                    "gpu_command",
                    "gpu_extra_args",
                    "gpu_env",
                    "gpu_port",
                    "tensor_parallel_size",
                    "gpu_memory_utilization",
                    "max_model_len",
                    "max_num_seqs",
                    "preemption_mode",
                    "gpu_shm_size_gb",
                    "kv_arena_mib",
                    "sim_gpu_device",
                ]
            },
        ),
        (
            "CPU engine",
            {
                "fields": [
                    "cpu_image",
                    "cpu_command",
                    "cpu_extra_args",
                    "cpu_env",
                    "cpu_port",
                    "cpu_max_num_seqs",
                    "omp_num_threads",
                    "cpu_affinity_mode",
                    "cpu_affinity",
                    "cpu_kv_cache_space_gb",
                    "cpu_memory_limit_gb",
                    "sim_cpu_device",
                ]
            },
        ),
        ("Health", {"fields": ["health_timeout_seconds"]}),
        ("Tracing", {"fields": ["otlp_traces_endpoint", "trace_detail"]}),
        ("What the agent would start", {"fields": ["docker_run_lines"]}),
    ]
    readonly_fields = ["docker_run_lines"]
    # What a person who may not change profiles sees in place of the env fields.
    hidden_env_fields = {"gpu_env": "gpu_env_values_hidden", "cpu_env": "cpu_env_values_hidden"}

    def get_fieldsets(self, request, obj=None):  # type: ignore[no-untyped-def]
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or may_see_env(request.user):
            return fieldsets
        swap = self.hidden_env_fields
        return [
            (name, {**options, "fields": [swap.get(f, f) for f in options["fields"]]})
            for name, options in fieldsets
        ]

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        fields = list(super().get_readonly_fields(request, obj))
        if obj is not None and not may_see_env(request.user):
            fields += self.hidden_env_fields.values()
        return fields

    def delete_with(self, obj: DeploymentProfile, *, acting_user: Actor) -> None:
        services.delete_profile(obj, acting_user=acting_user)

    @admin.display(description="GPU env")
    def gpu_env_values_hidden(self, obj: DeploymentProfile) -> str:
        return _json(hide_env(obj.gpu_env))

    @admin.display(description="CPU env")
    def cpu_env_values_hidden(self, obj: DeploymentProfile) -> str:
        return _json(hide_env(obj.cpu_env))

    @admin.display(description="docker run")
    def docker_run_lines(self, obj: DeploymentProfile | None) -> str:
        """The saved profile's two docker run lines (no node: no cpuset or devices); the
        dashboard's profile page renders them for a chosen node."""
        if obj is None or obj.pk is None:
            return "-"
        try:
            text = render_profile(obj, None, docker=True, show_secrets=False).text
        except FieldError as exc:
            text = f"cannot render: {exc}"
        page = reverse("dashboard:profile", args=[obj.name])
        return format_html('<pre>{}</pre><a href="{}">render for a node</a>', text, page)


class DeploymentEventInline(admin.TabularInline):  # type: ignore[type-arg]
    model = DeploymentEvent
    extra = 0
    can_delete = False
    readonly_fields = fields = ("created_at", "generation", "step", "level", "message")
    ordering = ["-created_at"]

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


class ContainerInline(admin.TabularInline):  # type: ignore[type-arg]
    model = ContainerInstance
    extra = 0
    readonly_fields = fields = (
        "role",
        "generation",
        "name",
        "engine_id",
        "status",
        "health",
        "exit_code",
        "endpoint",
    )

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(Deployment)
class DeploymentAdmin(ServiceDeleteAdmin):
    list_display = [
        "name",
        "node",
        "pinned",
        "profile",
        "desired_state",
        "state",
        "generation",
        "step",
        "state_changed_at",
    ]
    list_filter = ["state", "desired_state", "pinned", "node", "profile"]
    search_fields = ["name", "node__name", "profile__name"]
    readonly_fields = [
        "desired_state",
        "state",
        "state_reason",
        "state_changed_at",
        "generation",
        "step",
        "gpu_endpoint",
        "cpu_endpoint",
        "affinity_plan",
        "held_cards",
    ]
    inlines = [ContainerInline, DeploymentEventInline]

    @admin.display(description="cards held")
    def held_cards(self, obj: Deployment) -> str:
        claims = obj.accelerator_claims.select_related("accelerator").order_by("accelerator__index")
        return ", ".join(f"{c.accelerator.index}: {c.accelerator.uuid}" for c in claims) or "-"

    def delete_refusal(self, obj: Deployment) -> str:
        return services.deployment_delete_refusal(obj)

    def delete_with(self, obj: Deployment, *, acting_user: Actor) -> None:
        services.delete_deployment(obj, acting_user=acting_user)

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        if "node" in form.changed_data:
            obj.pinned = True  # an operator who names the node pins it there
        super().save_model(request, obj, form, change)

    # The benchmarks app adds "run_benchmark" (benchmarks/admin.py): it sits above this one.
    actions = ["deploy", "stop", "restart"]

    def _each(self, request, queryset, operation, verb):  # type: ignore[no-untyped-def]
        for deployment in queryset:
            try:
                operation(deployment, acting_user=request.user)
            except PlacementError as exc:
                self.message_user(request, f"{deployment}: {exc}", level=messages.ERROR)
            else:
                self.message_user(request, f"{deployment}: {verb} queued")

    @admin.action(description="Deploy (GPU engine, then CPU engine)")
    def deploy(self, request, queryset):  # type: ignore[no-untyped-def]
        self._each(request, queryset, services.request_deploy, "deploy")

    @admin.action(description="Stop")
    def stop(self, request, queryset):  # type: ignore[no-untyped-def]
        self._each(request, queryset, services.request_stop, "stop")

    @admin.action(description="Restart (new generation)")
    def restart(self, request, queryset):  # type: ignore[no-untyped-def]
        self._each(request, queryset, services.request_restart, "restart")


@admin.register(ContainerInstance)
class ContainerInstanceAdmin(RecordAdmin):
    list_display = ["name", "deployment", "role", "generation", "status", "health", "updated_at"]
    list_filter = ["role", "status", "health"]
    search_fields = ["name", "engine_id", "deployment__name"]


@admin.register(AgentCommand)
class AgentCommandAdmin(RecordAdmin):
    list_display = [
        "dispatch_id",
        "node",
        "deployment",
        "action",
        "role",
        "generation",
        "step",
        "status",
        "attempts",
        "created_at",
    ]
    list_filter = ["status", "action", "role", "node"]
    search_fields = ["dispatch_id", "deployment__name"]

    def get_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        # The spec carries the profile's env: its values only for people who may change
        # profiles (controlplane/deployments/masking.py).
        names = [f.name for f in AgentCommand._meta.fields]
        if not may_see_env(request.user):
            names[names.index("spec")] = "spec_env_values_hidden"
        return names

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return self.get_fields(request, obj)

    @admin.display(description="spec")
    def spec_env_values_hidden(self, obj: AgentCommand) -> str:
        return _json(hide_spec_env(obj.spec))


@admin.register(DeploymentEvent)
class DeploymentEventAdmin(RecordAdmin):
    list_display = ["deployment", "created_at", "generation", "step", "level", "message"]
    list_filter = ["level", "step"]
    search_fields = ["message", "deployment__name"]
