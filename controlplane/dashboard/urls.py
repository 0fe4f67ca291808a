from __future__ import annotations

from django.urls import path

from controlplane.dashboard.views import (
    batches,
    benchmarks,
    deployments,
    nodes,
    overview,
    playground,
    policy,
    profiles,
    tenants,
)

app_name = "dashboard"

urlpatterns = [
    path("", overview.overview, name="overview"),
    path("live/accelerators.json", overview.accelerators_json, name="accelerators-json"),
    path("live/serving.json", overview.serving_json, name="serving-json"),
    path("nodes/", nodes.node_list, name="nodes"),
    path("nodes/<str:name>/", nodes.node_detail, name="node"),
    path("deployments/", deployments.deployment_list, name="deployments"),
    path("deployments/new/", deployments.deployment_create, name="deployment-create"),
    path("deployments/<int:pk>/", deployments.deployment_detail, name="deployment"),
    path(
        "deployments/<int:pk>/timeline.json",
        deployments.deployment_timeline,
        name="deployment-timeline",
    ),
    path(
        "deployments/<int:pk>/playground/",
        playground.playground,
        name="deployment-playground",
    ),
    path(
        "deployments/<int:pk>/<slug:action>/",
        deployments.deployment_action,
        name="deployment-action",
    ),
    path("profiles/", profiles.profile_list, name="profiles"),
    path("profiles/new/", profiles.profile_create, name="profile-create"),
    path("profiles/<str:name>/", profiles.profile_detail, name="profile"),
    path("profiles/<str:name>/edit/", profiles.profile_edit, name="profile-edit"),
    path("policy/", policy.policy_index, name="policies"),
    path("policy/<slug:name>/", policy.policy_detail, name="policy"),
    path("policy/<slug:name>/rollback/", policy.policy_rollback, name="policy-rollback"),
    path("tenants/", tenants.tenant_list, name="tenants"),
    path("tenants/<str:name>/", tenants.tenant_detail, name="tenant"),
    path("tenants/<str:name>/keys/", tenants.tenant_issue_key, name="tenant-issue-key"),
    path(
        "tenants/<str:name>/keys/<int:key_id>/revoke/",
        tenants.tenant_revoke_key,
        name="tenant-revoke-key",
    ),
    path("tenants/<str:name>/delete/", tenants.tenant_delete, name="tenant-delete"),
    path("batches/", batches.batch_list, name="batches"),
    path("batches/<str:batch_id>/", batches.batch_detail, name="batch"),
    path("benchmarks/", benchmarks.benchmark_list, name="benchmarks"),
    path("benchmarks/new/", benchmarks.benchmark_create, name="benchmark-create"),
    path("benchmarks/compare/", benchmarks.benchmark_compare, name="benchmark-compare"),
    path("benchmarks/schedules/new/", benchmarks.schedule_create, name="schedule-create"),
    path("benchmarks/schedules/<int:pk>/", benchmarks.schedule_edit, name="schedule-edit"),
    path("benchmarks/<int:pk>/", benchmarks.benchmark_detail, name="benchmark"),
    path("benchmarks/<int:pk>/charts/", benchmarks.benchmark_charts, name="benchmark-charts"),
    path(
        "benchmarks/<int:pk>/progress.json",
        benchmarks.benchmark_progress,
        name="benchmark-progress",
    ),
    path("benchmarks/<int:pk>/cancel/", benchmarks.benchmark_cancel, name="benchmark-cancel"),
]
