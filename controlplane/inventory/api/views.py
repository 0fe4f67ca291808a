from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access.models import MachineCredential
from controlplane.access.permissions import ScopedPermission
from controlplane.access.principal import MachinePrincipal
from controlplane.access.viewsets import ScopedModelViewSet, ScopedReadOnlyViewSet
from controlplane.inventory import services
from controlplane.inventory.api.serializers import (
    AcceleratorSerializer,
    HeartbeatInSerializer,
    HeartbeatSerializer,
    InventorySerializer,
    NodeSerializer,
)
from controlplane.inventory.models import Accelerator, Node


class NodeFilter(filters.FilterSet):
    class Meta:
        model = Node
        fields = ["status", "name"]


class NodeViewSet(ScopedModelViewSet):
    queryset = Node.objects.select_related("cpu").prefetch_related("numa_nodes", "accelerators")
    serializer_class = NodeSerializer
    filterset_class = NodeFilter
    search_fields = ["name", "address", "hostname"]
    ordering_fields = ["name", "status", "last_heartbeat_at"]
    agent_methods = ("GET", "PUT", "POST")
    node_field = "pk"
    # What the agents' reports read of their node; the rest stays unloaded on that hot path.
    _report_fields = ("status", "inventory_hash")

    def get_queryset(self) -> QuerySet[Node]:
        queryset: QuerySet[Node] = super().get_queryset()
        if self.action in ("heartbeat", "inventory"):
            return queryset.select_related(None).prefetch_related(None).only(*self._report_fields)
        return queryset

    def check_permissions(self, request: Request) -> None:
        super().check_permissions(request)
        # An agent may only report (inventory, heartbeat) and read; never edit or create nodes.
        user = request.user
        agent_actions = {"list", "retrieve", "inventory", "heartbeat", "heartbeats"}
        if isinstance(user, MachinePrincipal) and self.action not in agent_actions:
            self.permission_denied(request, message="agents may only report for their own node")

    def perform_destroy(self, instance: Node) -> None:
        services.delete_node(instance, acting_user=self.request.user)

    @extend_schema(
        request=InventorySerializer,
        responses=inline_serializer(
            "InventoryResult",
            {"changed": serializers.BooleanField(), "inventory_hash": serializers.CharField()},
        ),
    )
    @action(detail=True, methods=["put"])
    def inventory(self, request: Request, pk: str | None = None) -> Response:
        node = self.get_object()
        serializer = InventorySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        changed = services.apply_inventory(
            node, serializer.validated_data, acting_user=request.user
        )
        node.refresh_from_db()
        return Response({"changed": changed, "inventory_hash": node.inventory_hash})

    @extend_schema(
        request=HeartbeatInSerializer,
        responses=inline_serializer(
            "HeartbeatAnswer",
            {
                "status": serializers.CharField(),
                "inventory_hash": serializers.CharField(),
                "heartbeat_interval_seconds": serializers.FloatField(),
            },
        ),
    )
    @action(detail=True, methods=["post"])
    def heartbeat(self, request: Request, pk: str | None = None) -> Response:
        node = self.get_object()
        serializer = HeartbeatInSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        node = services.record_heartbeat(node, serializer.validated_data)
        return Response(
            {
                "status": node.status,
                "inventory_hash": node.inventory_hash,
                "heartbeat_interval_seconds": settings.HEARTBEAT_INTERVAL_SECONDS,
            }
        )

    @extend_schema(responses=HeartbeatSerializer(many=True))
    @action(detail=True, methods=["get"], serializer_class=HeartbeatSerializer, filter_backends=[])
    def heartbeats(self, request: Request, pk: str | None = None) -> Response:
        node = self.get_object()
        page = self.paginate_queryset(node.heartbeats.all())
        return self.get_paginated_response(HeartbeatSerializer(page, many=True).data)

    @extend_schema(
        request=None,
        responses={
            201: inline_serializer(
                "AgentTokenIssued",
                {
                    "token": serializers.CharField(),
                    "credential_id": serializers.IntegerField(),
                    "node": serializers.CharField(),
                },
            )
        },
    )
    @action(detail=True, methods=["post"], url_path="agent-token")
    def agent_token(self, request: Request, pk: str | None = None) -> Response:
        """Issue a new agent token for this node. The token is shown only in this answer."""
        node = self.get_object()
        credential, token = MachineCredential.issue(
            "agent", f"agent-{node.name}", node=node, created_by=request.user
        )
        return Response(
            {"token": token, "credential_id": credential.pk, "node": node.name},
            status=status.HTTP_201_CREATED,
        )


class AcceleratorViewSet(ScopedReadOnlyViewSet):
    queryset = Accelerator.objects.select_related("node")
    serializer_class = AcceleratorSerializer
    filterset_fields = ["node", "kind", "simulated"]
    search_fields = ["model_name", "uuid", "node__name"]
    agent_methods = ("GET",)
    node_field = "node"


class AgentSelfView(APIView):
    """What an agent needs to start: its node, its heartbeat period and how long a command
    fetch may wait."""

    permission_classes = [ScopedPermission]
    agent_methods = ("GET",)

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        user = request.user
        if not isinstance(user, MachinePrincipal) or not user.is_agent:
            self.permission_denied(request, message="only an agent token has a node")
        node = Node.objects.get(pk=user.node_id)
        body: dict[str, Any] = {
            "node": NodeSerializer(node).data,
            "heartbeat_interval_seconds": settings.HEARTBEAT_INTERVAL_SECONDS,
            # Commands come from GET agent/commands; an agent holds no broker credential.
            "command_wait_seconds": settings.AGENT_COMMAND_WAIT_SECONDS,
        }
        return Response(body)
