from __future__ import annotations

from django.db.models import Count, Q
from django.http import Http404
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView

from controlplane.access.permissions import ScopedPermission
from controlplane.access.principal import MachinePrincipal
from controlplane.access.viewsets import ScopedModelViewSet
from controlplane.core.api import etag_matches
from controlplane.routers.models import RouterInstance
from controlplane.tenants import services
from controlplane.tenants.api.serializers import (
    IssuedKeySerializer,
    IssueKeySerializer,
    TenantKeySerializer,
    TenantSerializer,
    UsageAcceptedSerializer,
    UsageReportSerializer,
    UsageSeriesSerializer,
    series_payload,
)
from controlplane.tenants.choices import USAGE_WINDOWS
from controlplane.tenants.models import Tenant
from controlplane.tenants.usage import Usage, record_usage, usage_series

WINDOW_PARAMETER = OpenApiParameter(
    "window", str, enum=list(USAGE_WINDOWS), default="1h", description="how far back"
)


class TenantViewSet(ScopedModelViewSet):
    """Tenants by name. Writing needs the tenants app's Django permissions; every create,
    change, key and delete goes through ``controlplane.tenants.services`` (audited)."""

    queryset = Tenant.objects.annotate(
        active_key_count=Count("keys", filter=Q(keys__revoked_at__isnull=True))
    )
    serializer_class = TenantSerializer
    lookup_field = "name"
    search_fields = ["name", "description"]
    filterset_fields = ["active"]
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    # The keys' actions name their own permission (ScopedPermission reads it).
    required_perm: str | None = None

    def perform_create(self, serializer: BaseSerializer[Tenant]) -> None:
        data = dict(serializer.validated_data)
        serializer.instance = services.save_tenant(None, data, acting_user=self.request.user)

    def perform_update(self, serializer: BaseSerializer[Tenant]) -> None:
        data = dict(serializer.validated_data)
        tenant = self.get_object()
        serializer.instance = services.save_tenant(tenant, data, acting_user=self.request.user)

    def perform_destroy(self, instance: Tenant) -> None:
        services.delete_tenant(instance, acting_user=self.request.user)

    @extend_schema(
        methods=["GET"], responses=TenantKeySerializer(many=True), request=None, filters=False
    )
    @extend_schema(
        methods=["POST"], request=IssueKeySerializer, responses={201: IssuedKeySerializer}
    )
    @action(
        detail=True,
        methods=["get", "post"],
        serializer_class=TenantKeySerializer,
        filter_backends=[],
        required_perm="tenants.add_tenantkey",
    )
    def keys(self, request: Request, name: str | None = None) -> Response:
        """GET: the tenant's keys, never the keys themselves. POST: a new key, shown once in
        this answer (``key``); only its SHA-256 and first characters are kept."""
        tenant = self.get_object()
        if request.method == "GET":
            page = self.paginate_queryset(tenant.keys.select_related("created_by"))
            return self.get_paginated_response(TenantKeySerializer(page, many=True).data)
        serializer = IssueKeySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key, plaintext = services.issue_key(
            tenant, serializer.validated_data["label"], acting_user=request.user
        )
        body = {**IssuedKeySerializer(key).data, "key": plaintext}
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})

    @extend_schema(
        request=None,
        responses=TenantKeySerializer,
        parameters=[OpenApiParameter("key_id", int, OpenApiParameter.PATH)],
    )
    @action(
        detail=True,
        methods=["post"],
        # Any segment, so a bad id is this view's 404 (and another method its 405).
        url_path=r"keys/(?P<key_id>[^/.]+)/revoke",
        required_perm="tenants.change_tenantkey",
    )
    def revoke_key(self, request: Request, name: str | None = None, key_id: str = "") -> Response:
        """Revoke one key; routers refuse it from their next poll. Revoking it again changes
        nothing."""
        tenant = self.get_object()
        if not key_id.isdigit():
            raise Http404("no such key")
        key = get_object_or_404(tenant.keys.all(), pk=int(key_id))
        services.revoke_key(key, acting_user=request.user)
        return Response(TenantKeySerializer(key).data)

    @extend_schema(parameters=[WINDOW_PARAMETER], responses=UsageSeriesSerializer, filters=False)
    @action(detail=True, methods=["get"], filter_backends=[])
    def usage(self, request: Request, name: str | None = None) -> Response:
        """What every router reported for the tenant, minute by minute over the window."""
        tenant = self.get_object()
        window = request.query_params.get("window", "1h")
        series = usage_series(tenant, window)
        totals = Usage()
        for _, counts in series:
            totals.add(counts)
        return Response(series_payload(tenant, window, series, totals))


def router_principal(view: APIView, request: Request) -> MachinePrincipal:
    """The router credential behind ``request``; anyone else is refused (people too: these
    endpoints are the routers' own)."""
    user = request.user
    if not isinstance(user, MachinePrincipal) or not user.is_router:
        view.permission_denied(request, message="only a router token may do this")
    assert isinstance(user, MachinePrincipal)
    return user


class RoutingTenantsView(APIView):
    """The active tenants and their unrevoked keys' hashes, as routers read them, with an
    ETag; ``If-None-Match`` answers 304."""

    permission_classes = [ScopedPermission]
    router_methods = ("GET",)

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        router_principal(self, request)
        document = services.routing_document()
        etag = services.routing_etag(document)
        if etag_matches(request, etag):
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return Response(document, headers={"ETag": etag})


class RouterUsageView(APIView):
    """A router's tenant usage: deltas since its last accepted report."""

    permission_classes = [ScopedPermission]
    router_methods = ("POST",)

    @extend_schema(request=UsageReportSerializer, responses=UsageAcceptedSerializer)
    def post(self, request: Request, pk: int) -> Response:
        principal = router_principal(self, request)
        router = get_object_or_404(RouterInstance, pk=pk)
        if router.credential_id != principal.credential.pk:
            self.permission_denied(request, message="a router may only report its own usage")
        return Response(record_usage(router, request.data))
