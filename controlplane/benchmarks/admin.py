from __future__ import annotations

from django.contrib import admin

from controlplane.benchmarks import services
from controlplane.benchmarks.choices import DEFAULT_CONCURRENCY, DEFAULT_ITERATIONS
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample, Scenario
from controlplane.core.actors import Actor
from controlplane.core.admin import RecordAdmin, ServiceDeleteAdmin
from controlplane.deployments.admin import DeploymentAdmin


@admin.action(description="Run the short benchmark scenario (hetero mode)")
def run_benchmark(modeladmin, request, queryset):  # type: ignore[no-untyped-def]
    scenario = Scenario.objects.get(name="short")
    for deployment in queryset:
        run = services.create_run(
            acting_user=request.user,
            name=f"{deployment.name} short (admin)",
            scenario=scenario,
            deployment=deployment,
            mode="hetero",
            concurrency=list(DEFAULT_CONCURRENCY),
            iterations=DEFAULT_ITERATIONS,
        )
        modeladmin.message_user(request, f"{deployment}: benchmark run {run.pk} queued")


# An action of the deployment's page that belongs to this app (deployments sits below it).
DeploymentAdmin.actions = [*DeploymentAdmin.actions, run_benchmark]


@admin.register(Scenario)
class ScenarioAdmin(ServiceDeleteAdmin):
    list_display = [
        "name",
        "input_tokens",
        "output_tokens",
        "concurrency_min",
        "concurrency_max",
        "builtin",
    ]
    list_filter = ["builtin"]
    search_fields = ["name", "description"]

    def delete_refusal(self, obj: Scenario) -> str:
        return services.scenario_delete_refusal(obj)

    def delete_with(self, obj: Scenario, *, acting_user: Actor) -> None:
        services.delete_scenario(obj, acting_user=acting_user)


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(ServiceDeleteAdmin):
    list_display = [
        "id",
        "name",
        "scenario",
        "mode",
        "deployment",
        "status",
        "progress",
        "regression",
        "is_baseline",
        "created_at",
    ]
    list_filter = ["status", "mode", "scenario", "regression", "is_baseline"]
    search_fields = ["name", "deployment__name", "target_url"]
    readonly_fields = [
        "status",
        "progress",
        "summary",
        "error",
        "cancel_requested",
        "regression",
        "regression_detail",
        "started_at",
        "finished_at",
        "schedule",
    ]
    actions = ["run_again", "cancel"]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        super().save_model(request, obj, form, change)
        if not change:
            services.queue_run(obj)

    @admin.action(description="Run the selected benchmarks again (new runs)")
    def run_again(self, request, queryset):  # type: ignore[no-untyped-def]
        for run in queryset:
            services.create_run(
                acting_user=request.user,
                name=run.name,
                scenario=run.scenario,
                deployment=run.deployment,
                target_url=run.target_url,
                mode=run.mode,
                concurrency=run.concurrency,
                iterations=run.iterations,
                warmup=run.warmup,
                seed=run.seed,
            )
        self.message_user(request, f"{queryset.count()} benchmark run(s) queued")

    @admin.action(description="Cancel")
    def cancel(self, request, queryset):  # type: ignore[no-untyped-def]
        for run in queryset:
            services.request_cancel(run, acting_user=request.user)

    def delete_refusal(self, obj: BenchmarkRun) -> str:
        return services.run_delete_refusal(obj)

    def delete_with(self, obj: BenchmarkRun, *, acting_user: Actor) -> None:
        services.delete_run(obj, acting_user=acting_user)


@admin.register(BenchmarkSample)
class BenchmarkSampleAdmin(RecordAdmin):
    list_display = ["run", "mode", "concurrency", "index", "ok", "ttft_ms", "tpot_ms", "e2e_ms"]
    list_filter = ["mode", "ok"]
