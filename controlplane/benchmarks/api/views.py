from __future__ import annotations

from collections.abc import Mapping

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView

from controlplane.access.permissions import ScopedPermission
from controlplane.access.viewsets import ScopedModelViewSet
from controlplane.benchmarks import analysis, services
from controlplane.benchmarks.api.serializers import (
    BenchmarkRunSerializer,
    BenchmarkSampleSerializer,
    ScenarioSerializer,
)
from controlplane.benchmarks.choices import RunStatus
from controlplane.benchmarks.models import BenchmarkRun, Scenario


class ScenarioViewSet(ScopedModelViewSet):
    queryset = Scenario.objects.all()
    serializer_class = ScenarioSerializer
    lookup_field = "name"
    search_fields = ["name", "description"]

    def perform_destroy(self, instance: Scenario) -> None:
        services.delete_scenario(instance, acting_user=self.request.user)


class BenchmarkRunViewSet(ScopedModelViewSet):
    queryset = BenchmarkRun.objects.select_related("scenario", "deployment")
    serializer_class = BenchmarkRunSerializer
    filterset_fields = ["status", "mode", "scenario", "deployment", "regression", "is_baseline"]
    search_fields = ["name"]
    ordering_fields = ["created_at", "finished_at"]
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def perform_destroy(self, instance: BenchmarkRun) -> None:
        services.delete_run(instance, acting_user=self.request.user)

    def perform_create(self, serializer: BaseSerializer[BenchmarkRun]) -> None:
        serializer.instance = services.create_run(
            acting_user=self.request.user, **serializer.validated_data
        )

    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        # Only naming and the baseline flag change after creation; the run itself is history.
        allowed = {"name", "is_baseline"}
        if not isinstance(request.data, Mapping):
            raise ValidationError({"non_field_errors": "give a JSON object of fields to change"})
        unknown = sorted(set(request.data) - allowed)
        if unknown:
            raise ValidationError({unknown[0]: "cannot be changed after the run is created"})
        return super().partial_update(request, *args, **kwargs)

    @extend_schema(request=None, responses={202: BenchmarkRunSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        run = services.request_cancel(self.get_object(), acting_user=request.user)
        return Response(self.get_serializer(run).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        parameters=[
            OpenApiParameter("ids", str, required=True, description="1 to 10 run ids: 3,5,8")
        ],
        responses=OpenApiTypes.OBJECT,
    )
    @action(detail=False, methods=["get"])
    def compare(self, request: Request) -> Response:
        """Runs side by side: ``?ids=3,5,8`` gives each run's figures per mode and level."""
        raw = request.query_params.get("ids", "")
        try:
            ids = [int(part) for part in raw.split(",") if part.strip()]
        except ValueError:
            raise ValidationError(
                {"ids": "give run ids separated by commas, e.g. ids=3,5"}
            ) from None
        if not 1 <= len(ids) <= 10:
            raise ValidationError({"ids": f"compare between 1 and 10 runs; got {len(ids)}"})
        runs = {run.pk: run for run in self.get_queryset().filter(pk__in=ids)}
        missing = [i for i in ids if i not in runs]
        if missing:
            raise ValidationError({"ids": f"no benchmark run {missing[0]}"})
        return Response(
            {
                "runs": [
                    {
                        "id": runs[i].pk,
                        "name": str(runs[i]),
                        "scenario": runs[i].scenario.name,
                        "status": runs[i].status,
                        "rows": [
                            {"mode": mode, "concurrency": level, **figures}
                            for (mode, level), figures in sorted(
                                analysis.rows_by_key(runs[i].summary).items()
                            )
                        ],
                    }
                    for i in ids
                ]
            }
        )

    @extend_schema(responses=BenchmarkSampleSerializer(many=True))
    @action(
        detail=True, methods=["get"], serializer_class=BenchmarkSampleSerializer, filter_backends=[]
    )
    def samples(self, request: Request, pk: str | None = None) -> Response:
        run = self.get_object()
        page = self.paginate_queryset(run.samples.all())
        return self.get_paginated_response(BenchmarkSampleSerializer(page, many=True).data)


class AdvisorView(APIView):
    """The mode advisor: ``?goal=latency|throughput|slo&deployment=ID&ttft_slo_ms=&tpot_slo_ms=``.

    Decides from the newest successful runs and shows the figures behind the advice."""

    permission_classes = [ScopedPermission]

    def get_queryset(self) -> QuerySet[BenchmarkRun]:
        # Names the model ScopedPermission checks; the advisor's own query is in services.
        return BenchmarkRun.objects.filter(status=RunStatus.SUCCEEDED).order_by("-finished_at")

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        params = request.query_params
        goal = params.get("goal", "throughput")
        deployment_id: int | None = None
        if params.get("deployment"):
            if not params["deployment"].isdigit():
                raise ValidationError({"deployment": "must be a deployment id"})
            deployment_id = int(params["deployment"])
        slo: dict[str, float] = {}
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            if params.get(name):
                try:
                    slo[name] = float(params[name])
                except ValueError:
                    raise ValidationError({name: "must be a number of milliseconds"}) from None
                if slo[name] <= 0:
                    raise ValidationError({name: "must be positive"})
        summaries = services.advisor_summaries(deployment_id)
        try:
            advice = analysis.advise(
                summaries,
                goal,
                ttft_slo_ms=slo.get("ttft_slo_ms"),
                tpot_slo_ms=slo.get("tpot_slo_ms"),
            )
        except ValueError as exc:
            raise ValidationError({"goal": str(exc)}) from None
        return Response({**advice.to_dict(), "runs_considered": len(summaries)})
