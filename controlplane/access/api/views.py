from __future__ import annotations

from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.access.api.serializers import CredentialSerializer
from controlplane.access.models import MachineCredential
from controlplane.access.viewsets import ScopedViewSetMixin


class CredentialViewSet(
    ScopedViewSetMixin,
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,  # type: ignore[type-arg]
):
    """Machine credentials. The token is returned once, by create; only its hash is kept."""

    queryset = MachineCredential.objects.select_related("node")
    serializer_class = CredentialSerializer
    filterset_fields = ["kind", "node"]

    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        credential, token = MachineCredential.issue(
            data["kind"], data["name"], node=data.get("node"), created_by=request.user
        )
        body = {**CredentialSerializer(credential).data, "token": token}
        return Response(body, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        credential = self.get_object()
        credential.revoke(acting_user=request.user)
        return Response(CredentialSerializer(credential).data)
