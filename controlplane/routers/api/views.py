from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access.permissions import ScopedPermission
from controlplane.access.principal import MachinePrincipal
from controlplane.access.viewsets import ScopedReadOnlyViewSet
from controlplane.core.api import etag_matches
from controlplane.routers import services
from controlplane.routers.api.serializers import (
    RegisterSerializer,
    RouterInstanceSerializer,
    RouterSampleSerializer,
    StatsSerializer,
)
from controlplane.routers.models import RouterInstance


class RouterInstanceViewSet(ScopedReadOnlyViewSet):
    queryset = RouterInstance.objects.all()
    serializer_class = RouterInstanceSerializer
    search_fields = ["name"]

    @extend_schema(responses=RouterSampleSerializer(many=True))
    @action(
        detail=True, methods=["get"], serializer_class=RouterSampleSerializer, filter_backends=[]
    )
    def samples(self, request: Request, pk: str | None = None) -> Response:
        router = self.get_object()
        page = self.paginate_queryset(router.samples.all())
        return self.get_paginated_response(RouterSampleSerializer(page, many=True).data)


class _RouterOnlyView(APIView):
    permission_classes = [ScopedPermission]
    router_methods: tuple[str, ...] = ("POST",)

    def principal(self, request: Request) -> MachinePrincipal:
        user = request.user
        if not isinstance(user, MachinePrincipal) or not user.is_router:
            self.permission_denied(request, message="only a router token may do this")
        assert isinstance(user, MachinePrincipal)
        return user


class RouterRegisterView(_RouterOnlyView):
    @extend_schema(request=RegisterSerializer, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request) -> Response:
        principal = self.principal(request)
        serializer = RegisterSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        router = services.register_router(principal.credential, **serializer.validated_data)
        return Response({"id": router.pk, "name": router.name}, status=status.HTTP_200_OK)


class RouterStatsView(_RouterOnlyView):
    @extend_schema(request=StatsSerializer, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request, pk: int) -> Response:
        principal = self.principal(request)
        router = get_object_or_404(RouterInstance, pk=pk)
        if router.credential_id != principal.credential.pk:
            self.permission_denied(request, message="a router may only report its own stats")
        serializer = StatsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.record_stats(router, serializer.validated_data)
        return Response({"accepted": True})


class RoutingDeploymentsView(APIView):
    """Running deployments with their engine endpoints, for routers, with an ETag."""

    permission_classes = [ScopedPermission]
    router_methods = ("GET",)

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        payload = services.routable_deployments()
        etag = services.deployments_etag(payload)
        if etag_matches(request, etag):
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return Response({"deployments": payload}, headers={"ETag": etag})
