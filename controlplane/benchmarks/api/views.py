from __future__ import annotations

from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from controlplane.benchmarks import services
from controlplane.benchmarks.api.serializers import (
    BenchmarkRunSerializer,
    BenchmarkSampleSerializer,
    ScenarioSerializer,
)
from controlplane.benchmarks.models import BenchmarkRun, Scenario
from controlplane.core.viewsets import ScopedModelViewSet


class ScenarioViewSet(ScopedModelViewSet):
    queryset = Scenario.objects.all()
    serializer_class = ScenarioSerializer
    lookup_field = "name"
    search_fields = ["name", "description"]

    def perform_destroy(self, instance: Scenario) -> None:
        if instance.builtin:
            raise ValidationError({"name": f"{instance.name!r} is built in and cannot be deleted"})
        if instance.runs.exists():
            raise ValidationError({"name": f"{instance.name!r} has benchmark runs"})
        instance.delete()


class BenchmarkRunViewSet(ScopedModelViewSet):
    queryset = BenchmarkRun.objects.select_related("scenario", "deployment")
    serializer_class = BenchmarkRunSerializer
    filterset_fields = ["status", "mode", "scenario", "deployment", "regression", "is_baseline"]
    search_fields = ["name"]
    ordering_fields = ["created_at", "finished_at"]
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def perform_create(self, serializer: BaseSerializer[BenchmarkRun]) -> None:
        serializer.instance = services.create_run(
            acting_user=self.request.user, **serializer.validated_data
        )

    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        # Only naming and the baseline flag change after creation; the run itself is history.
        allowed = {"name", "is_baseline"}
        unknown = sorted(set(request.data) - allowed)
        if unknown:
            raise ValidationError({unknown[0]: "cannot be changed after the run is created"})
        return super().partial_update(request, *args, **kwargs)

    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        run = services.request_cancel(self.get_object(), acting_user=request.user)
        return Response(self.get_serializer(run).data, status=status.HTTP_202_ACCEPTED)

    @action(detail=True, methods=["get"])
    def samples(self, request: Request, pk: str | None = None) -> Response:
        run = self.get_object()
        page = self.paginate_queryset(run.samples.all())
        return self.get_paginated_response(BenchmarkSampleSerializer(page, many=True).data)
