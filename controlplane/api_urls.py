"""Every REST endpoint, under /api/v1/."""

from __future__ import annotations

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from controlplane.access.api.views import CredentialViewSet
from controlplane.benchmarks.api.views import AdvisorView, BenchmarkRunViewSet, ScenarioViewSet
from controlplane.core.api import health
from controlplane.core.metrics import MetricsView
from controlplane.deployments.api.views import (
    AgentCommandsView,
    CommandResultView,
    CommandViewSet,
    ContainerViewSet,
    DeploymentViewSet,
    NodeContainersView,
    ProfileViewSet,
)
from controlplane.inventory.api.views import AcceleratorViewSet, AgentSelfView, NodeViewSet
from controlplane.policy.api.views import PolicyViewSet, RoutingPolicyView
from controlplane.routers.api.views import (
    RouterInstanceViewSet,
    RouterRegisterView,
    RouterStatsView,
    RoutingDeploymentsView,
)
from controlplane.tenants.api.views import RouterUsageView, RoutingTenantsView, TenantViewSet

router = DefaultRouter()
router.trailing_slash = "/?"  # machines and people may write either form
router.register("nodes", NodeViewSet)
router.register("accelerators", AcceleratorViewSet)
router.register("credentials", CredentialViewSet)
router.register("profiles", ProfileViewSet)
router.register("deployments", DeploymentViewSet)
router.register("containers", ContainerViewSet)
router.register("commands", CommandViewSet)
router.register("policies", PolicyViewSet)
router.register("routers", RouterInstanceViewSet)
router.register("scenarios", ScenarioViewSet)
router.register("benchmark-runs", BenchmarkRunViewSet)
router.register("tenants", TenantViewSet)

urlpatterns = [
    path("health", health, name="api-health"),
    path("agent/self", AgentSelfView.as_view(), name="agent-self"),
    path("agent/commands", AgentCommandsView.as_view(), name="agent-commands"),
    path("nodes/<int:pk>/containers", NodeContainersView.as_view(), name="node-containers"),
    path("commands/<uuid:dispatch_id>/result", CommandResultView.as_view(), name="command-result"),
    path("routers/register", RouterRegisterView.as_view(), name="router-register"),
    path("routers/<int:pk>/stats", RouterStatsView.as_view(), name="router-stats"),
    path("routers/<int:pk>/usage", RouterUsageView.as_view(), name="router-usage"),
    path("routing/policies/<slug:name>", RoutingPolicyView.as_view(), name="routing-policy"),
    path("routing/deployments", RoutingDeploymentsView.as_view(), name="routing-deployments"),
    path("routing/tenants", RoutingTenantsView.as_view(), name="routing-tenants"),
    path("advisor", AdvisorView.as_view(), name="advisor"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("", include(router.urls)),
]
