from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView

from controlplane.access.permissions import ScopedPermission
from controlplane.access.viewsets import ScopedModelViewSet
from controlplane.core.api import etag_matches
from controlplane.policy import services
from controlplane.policy.api.serializers import (
    PolicyChangeSerializer,
    PolicyRevisionSerializer,
    PolicySerializer,
    RollbackSerializer,
    routing_payload,
)
from controlplane.policy.models import KNOB_NAMES, SchedulingPolicy


class PolicyViewSet(ScopedModelViewSet):
    """Policies by name. Changing knobs goes through ``change`` (PATCH-like, with a reason),
    so every change is a revision; PUT/PATCH of the row itself only edits the description."""

    queryset = SchedulingPolicy.objects.all()
    serializer_class = PolicySerializer
    lookup_field = "name"
    search_fields = ["name"]
    router_methods = ("GET",)
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def perform_create(self, serializer: BaseSerializer[SchedulingPolicy]) -> None:
        data = dict(serializer.validated_data)
        if "name" not in data:
            raise ValidationError({"name": "This field is required."})
        reason = data.pop("reason")
        name = data.pop("name")
        description = data.pop("description", "")
        policy = services.create_policy(
            name, acting_user=self.request.user, reason=reason, description=description, **data
        )
        serializer.instance = policy

    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        policy = self.get_object()
        data = request.data
        if not isinstance(data, dict):
            raise ValidationError(
                {"non_field_errors": ["send a JSON object of knobs and a reason"]}
            )
        knobs = {k: v for k, v in data.items() if k in KNOB_NAMES}
        unknown = [k for k in data if k not in (*KNOB_NAMES, "reason", "description")]
        if unknown:
            raise ValidationError({unknown[0]: ["unknown field"]})
        if "description" in data and not knobs:
            policy.description = str(data["description"])
            policy.save(update_fields=["description", "updated_at"])
            return Response(self.get_serializer(policy).data)
        change = PolicyChangeSerializer(data={"reason": data.get("reason"), "knobs": knobs})
        change.is_valid(raise_exception=True)
        services.update_policy(
            policy,
            changes=change.validated_data["knobs"],
            acting_user=request.user,
            reason=change.validated_data["reason"],
        )
        # update_policy/rollback_policy refresh ``policy`` in place.
        return Response(self.get_serializer(policy).data)

    def perform_destroy(self, instance: SchedulingPolicy) -> None:
        services.delete_policy(instance, acting_user=self.request.user)

    @extend_schema(responses=PolicyRevisionSerializer(many=True))
    @action(
        detail=True, methods=["get"], serializer_class=PolicyRevisionSerializer, filter_backends=[]
    )
    def revisions(self, request: Request, name: str | None = None) -> Response:
        policy = self.get_object()
        page = self.paginate_queryset(policy.revisions.select_related("created_by"))
        return self.get_paginated_response(PolicyRevisionSerializer(page, many=True).data)

    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, name: str | None = None) -> Response:
        policy = self.get_object()
        serializer = RollbackSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.rollback_policy(
            policy,
            to_version=serializer.validated_data["version"],
            acting_user=request.user,
            reason=serializer.validated_data["reason"],
        )
        # update_policy/rollback_policy refresh ``policy`` in place.
        return Response(self.get_serializer(policy).data)


class RoutingPolicyView(APIView):
    """The live policy as routers consume it, with an ETag; ``If-None-Match`` answers 304."""

    permission_classes = [ScopedPermission]
    router_methods = ("GET",)

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request, name: str) -> Response:
        policy = get_object_or_404(SchedulingPolicy, name=name)
        etag = policy.etag
        if etag_matches(request, etag):
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return Response(routing_payload(policy), headers={"ETag": etag})
