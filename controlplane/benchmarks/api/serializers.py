from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.benchmarks.models import MAX_CONCURRENCY, BenchmarkRun, BenchmarkSample, Scenario
from loadgen.goodput import DEFAULT_BISECTIONS, parse_rates

MAX_REQUESTS_PER_RUN = 1_000_000  # every request is stored as a sample row


class ScenarioSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = Scenario
        fields = [
            "id",
            "name",
            "description",
            "input_tokens",
            "output_tokens",
            "concurrency_min",
            "concurrency_max",
            "builtin",
        ]
        read_only_fields = ["builtin"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        lo = attrs.get("concurrency_min", getattr(self.instance, "concurrency_min", 1))
        hi = attrs.get("concurrency_max", getattr(self.instance, "concurrency_max", 8))
        if lo > hi:
            raise serializers.ValidationError(
                {"concurrency_min": f"must not exceed concurrency_max ({hi}); got {lo}"}
            )
        return attrs


@extend_schema_field(
    {
        "oneOf": [
            {"type": "integer"},
            {"type": "array", "items": {"type": "integer"}},
            {"type": "string", "example": "1-8"},
        ]
    }
)
class ConcurrencyField(serializers.Field):  # type: ignore[type-arg]
    """Accepts 8, [1, 2, 4, 8], "1,2,4,8" or "1-8" (a range gives every level)."""

    def to_internal_value(self, data: Any) -> list[int]:
        levels: list[int]
        try:
            if isinstance(data, bool):
                raise ValueError
            if isinstance(data, int):
                levels = [data]
            elif isinstance(data, list):
                if len(data) > MAX_CONCURRENCY:
                    raise serializers.ValidationError(
                        f"give at most {MAX_CONCURRENCY} concurrency levels"
                    )
                if not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
                    raise ValueError
                levels = list(data)
            elif isinstance(data, str) and "-" in data and "," not in data:
                lo_s, hi_s = data.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if lo > hi:
                    raise ValueError
                if lo < 1 or hi > MAX_CONCURRENCY:  # checked before the range is expanded
                    raise serializers.ValidationError(
                        f"each level must be between 1 and {MAX_CONCURRENCY}; got {lo}-{hi}"
                    )
                levels = list(range(lo, hi + 1))
            elif isinstance(data, str):
                if data.count(",") >= MAX_CONCURRENCY:
                    raise serializers.ValidationError(
                        f"give at most {MAX_CONCURRENCY} concurrency levels"
                    )
                levels = [int(x) for x in data.split(",") if x.strip()]
            else:
                raise ValueError
        except ValueError:
            raise serializers.ValidationError(
                "give an integer, a list of integers, '1,2,4' or a range '1-8'"
            ) from None
        if not levels:
            raise serializers.ValidationError("give at least one concurrency level")
        bad = [c for c in levels if not 1 <= c <= MAX_CONCURRENCY]
        if bad:
            raise serializers.ValidationError(
                f"each level must be between 1 and {MAX_CONCURRENCY}; got {bad[0]}"
            )
        return sorted(set(levels))

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field({"type": "array", "items": {"type": "number"}})
class RatesField(serializers.Field):  # type: ignore[type-arg]
    """Request rates of a goodput sweep: a list of numbers or ``"1,2,4"``, strictly ascending."""

    def to_internal_value(self, data: Any) -> list[float]:
        if isinstance(data, list):
            if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in data):
                raise serializers.ValidationError("give a list of numbers or '1,2,4'")
            text = ",".join(repr(float(x)) for x in data)
        elif isinstance(data, str):
            text = data
        else:
            raise serializers.ValidationError("give a list of numbers or '1,2,4'")
        if not text.strip():
            return []
        try:
            rates = parse_rates(text, "request_rates")
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        if any(rate == float("inf") for rate in rates):
            raise serializers.ValidationError("request_rates: a sweep needs finite rates")
        return list(rates)

    def to_representation(self, value: Any) -> Any:
        return value


class BenchmarkRunSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    scenario = serializers.SlugRelatedField(
        slug_field="name",
        queryset=Scenario.objects.all(),
        error_messages={"does_not_exist": "unknown scenario {value!r}"},
    )
    concurrency = ConcurrencyField(required=False)
    request_rates = RatesField(required=False)

    class Meta:
        model = BenchmarkRun
        fields = [
            "id",
            "name",
            "scenario",
            "deployment",
            "target_url",
            "mode",
            "concurrency",
            "request_rates",
            "slo_ttft_ms",
            "slo_tpot_ms",
            "slo_attainment",
            "find_max_goodput",
            "iterations",
            "warmup",
            "seed",
            "status",
            "progress",
            "summary",
            "error",
            "cancel_requested",
            "is_baseline",
            "regression",
            "regression_detail",
            "schedule",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = [
            "status",
            "progress",
            "summary",
            "error",
            "cancel_requested",
            "regression",
            "regression_detail",
            "schedule",
            "created_at",
            "started_at",
            "finished_at",
        ]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs.get("deployment") and not attrs.get("target_url"):
            raise serializers.ValidationError(
                {"target_url": "give a deployment or a target URL to benchmark"}
            )
        levels = attrs.get("concurrency") or []
        rates = attrs.get("request_rates") or []
        iterations = attrs.get("iterations", 0) + attrs.get("warmup", 0)
        modes = 3 if attrs.get("mode") == "all" else 1
        if rates:
            if attrs.get("slo_ttft_ms") is None and attrs.get("slo_tpot_ms") is None:
                raise serializers.ValidationError(
                    {"slo_ttft_ms": "a goodput sweep needs slo_ttft_ms or slo_tpot_ms"}
                )
            points = len(rates) + (DEFAULT_BISECTIONS if attrs.get("find_max_goodput") else 0)
            total = iterations * points * modes
            shape = f"(iterations + warmup) x {points} rates x {modes} modes"
        else:
            total = iterations * len(levels) * modes
            shape = f"(iterations + warmup) x {len(levels)} levels x {modes} modes"
        if total > MAX_REQUESTS_PER_RUN:
            raise serializers.ValidationError(
                {
                    "iterations": f"the run would send {total:,} requests ({shape}); "
                    f"the limit is {MAX_REQUESTS_PER_RUN:,}"
                }
            )
        return attrs


class BenchmarkSampleSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = BenchmarkSample
        fields = [
            "mode",
            "concurrency",
            "request_rate",
            "index",
            "ok",
            "error",
            "prompt_tokens",
            "output_tokens",
            "ttft_ms",
            "tpot_ms",
            "e2e_ms",
            "started_at",
        ]
