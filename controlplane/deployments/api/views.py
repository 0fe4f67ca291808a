from __future__ import annotations

from django.conf import settings
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView

from controlplane.access.models import MachineCredential
from controlplane.access.permissions import ScopedPermission
from controlplane.access.principal import MachinePrincipal
from controlplane.access.viewsets import ScopedModelViewSet, ScopedReadOnlyViewSet
from controlplane.deployments import delivery, services, workflow
from controlplane.deployments.api.serializers import (
    AgentCommandSerializer,
    CommandBatchSerializer,
    CommandFetchSerializer,
    CommandResultSerializer,
    ContainerReportSerializer,
    ContainerSerializer,
    DeploymentEventSerializer,
    DeploymentSerializer,
    ProfileSerializer,
)
from controlplane.deployments.models import (
    AgentCommand,
    ContainerInstance,
    Deployment,
    DeploymentProfile,
)
from controlplane.inventory.models import Node


class ProfileViewSet(ScopedModelViewSet):
    queryset = DeploymentProfile.objects.all()
    serializer_class = ProfileSerializer
    filterset_fields = ["engine", "quantization", "pd_protocol"]
    search_fields = ["name", "model", "served_model_name"]

    def perform_create(self, serializer: BaseSerializer[DeploymentProfile]) -> None:
        serializer.instance = services.save_profile(
            None, dict(serializer.validated_data), acting_user=self.request.user
        )

    def perform_update(self, serializer: BaseSerializer[DeploymentProfile]) -> None:
        serializer.instance = services.save_profile(
            serializer.instance, dict(serializer.validated_data), acting_user=self.request.user
        )

    def perform_destroy(self, instance: DeploymentProfile) -> None:
        services.delete_profile(instance, acting_user=self.request.user)


class DeploymentViewSet(ScopedModelViewSet):
    queryset = Deployment.objects.select_related("profile", "node", "policy").prefetch_related(
        "containers", "accelerator_claims__accelerator"
    )
    serializer_class = DeploymentSerializer
    filterset_fields = ["state", "desired_state", "node", "profile"]
    search_fields = ["name", "node__name", "profile__name"]
    agent_methods = ("GET",)
    router_methods = ("GET",)
    node_field = "node"

    def perform_create(self, serializer: BaseSerializer[Deployment]) -> None:
        data = dict(serializer.validated_data)
        start = data.pop("start", False)
        data.pop("pinned", None)
        serializer.instance = services.create_deployment(
            name=data.pop("name"),
            profile=data.pop("profile"),
            node=data.pop("node", None),
            policy=data.pop("policy", None),
            acting_user=self.request.user,
            start=start,
            **data,
        )

    def perform_update(self, serializer: BaseSerializer[Deployment]) -> None:
        data = serializer.validated_data
        replicas = data.pop("replicas", None)
        deployment = serializer.save()
        if replicas is not None and replicas != deployment.replicas:
            services.set_replicas(deployment, replicas, acting_user=self.request.user)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def deploy(self, request: Request, pk: str | None = None) -> Response:
        deployment = services.request_deploy(self.get_object(), acting_user=request.user)
        return Response(self.get_serializer(deployment).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, pk: str | None = None) -> Response:
        deployment = services.request_stop(self.get_object(), acting_user=request.user)
        return Response(self.get_serializer(deployment).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, pk: str | None = None) -> Response:
        deployment = services.request_restart(self.get_object(), acting_user=request.user)
        return Response(self.get_serializer(deployment).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        responses=DeploymentEventSerializer(many=True),
        parameters=[OpenApiParameter("after", int, description="only events after this id")],
    )
    @action(
        detail=True, methods=["get"], serializer_class=DeploymentEventSerializer, filter_backends=[]
    )
    def events(self, request: Request, pk: str | None = None) -> Response:
        deployment = self.get_object()
        events = deployment.events.all()
        after = request.query_params.get("after")
        if after and after.isdigit():
            events = events.filter(pk__gt=int(after))
        page = self.paginate_queryset(events)
        return self.get_paginated_response(DeploymentEventSerializer(page, many=True).data)

    def perform_destroy(self, instance: Deployment) -> None:
        services.delete_deployment(instance, acting_user=self.request.user)


class ContainerViewSet(ScopedReadOnlyViewSet):
    queryset = ContainerInstance.objects.select_related("deployment")
    serializer_class = ContainerSerializer
    filterset_fields = ["deployment", "role", "status", "generation"]
    agent_methods = ("GET",)
    node_field = "deployment__node"


class CommandViewSet(ScopedReadOnlyViewSet):
    queryset = AgentCommand.objects.select_related("node", "deployment")
    serializer_class = AgentCommandSerializer
    filterset_fields = ["node", "deployment", "status", "action"]
    agent_methods = ("GET",)
    node_field = "node"


class _AgentOnlyView(APIView):
    """Base for endpoints only the agent of the node concerned may write."""

    permission_classes = [ScopedPermission]
    agent_methods: tuple[str, ...] = ("POST", "PUT")
    required_perm = "deployments.change_containerinstance"

    def check_node(self, request: Request, node: Node) -> None:
        user = request.user
        if isinstance(user, MachinePrincipal) and user.node_id != node.pk:
            self.permission_denied(request, message="this node belongs to another agent")

    def get_queryset(self) -> QuerySet[ContainerInstance]:
        return ContainerInstance.objects.all()


class NodeContainersView(_AgentOnlyView):
    @extend_schema(request=ContainerReportSerializer, responses=OpenApiTypes.OBJECT)
    def put(self, request: Request, pk: int) -> Response:
        node = get_object_or_404(Node, pk=pk)
        self.check_node(request, node)
        serializer = ContainerReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        updated = services.sync_containers(node, serializer.validated_data["containers"])
        return Response({"updated": updated})


class CommandResultView(_AgentOnlyView):
    agent_methods = ("POST",)

    @extend_schema(request=CommandResultSerializer, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request, dispatch_id: str) -> Response:
        command = get_object_or_404(AgentCommand.objects.select_related("node"), pk=dispatch_id)
        self.check_node(request, command.node)
        serializer = CommandResultSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if data["containers"]:
            services.sync_containers(command.node, data["containers"])
        accepted_first = workflow.record_command_result(
            command, status=data["status"], detail=data["detail"], output=data["output"]
        )
        return Response({"accepted": True, "duplicate": not accepted_first})


class AgentCommandsView(_AgentOnlyView):
    """An agent fetches its own node's commands: the only way a command reaches an agent."""

    agent_methods = ("GET",)

    @extend_schema(
        parameters=[CommandFetchSerializer],
        responses=CommandBatchSerializer,
        description="The calling agent's queued commands not yet handed to its session, "
        "oldest first; waits up to `wait` seconds for one. Agent tokens only.",
    )
    def get(self, request: Request) -> Response:
        user = request.user
        if not isinstance(user, MachinePrincipal) or not user.is_agent or user.node_id is None:
            self.permission_denied(request, message="only an agent token has commands")
        query = CommandFetchSerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        wait = min(query.validated_data["wait"], settings.AGENT_COMMAND_WAIT_SECONDS)
        credential = user.credential
        commands = delivery.fetch(
            user.node_id,
            query.validated_data["session"],
            wait,
            still_authorized=lambda: MachineCredential.objects.filter(
                pk=credential.pk, revoked_at__isnull=True
            ).exists(),
        )
        # The node's name only when there is something to hand out (most fetches: nothing).
        names = Node.objects.filter(pk=user.node_id).values_list("name", flat=True)
        name = (names.first() or "") if commands else ""
        body = {"commands": [delivery.as_message(c, name) for c in commands]}
        return Response(CommandBatchSerializer(body).data)
