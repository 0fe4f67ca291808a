from __future__ import annotations

from rest_framework import serializers

from common.serving import ServingError, clean_serving
from controlplane.routers import destinations
from controlplane.routers.choices import DECISIONS
from controlplane.routers.models import RouterInstance, RouterStatsSample


class RouterInstanceSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    is_alive = serializers.BooleanField(read_only=True)
    listen_url_configured = serializers.SerializerMethodField(
        help_text="whether listen_url is one of ROUTER_URLS; the control plane sends nothing "
        "to an address a router only reported"
    )

    def get_listen_url_configured(self, router: RouterInstance) -> bool:
        return destinations.is_configured(router.listen_url)

    class Meta:
        model = RouterInstance
        fields = [
            "id",
            "name",
            "version",
            "listen_url",
            "listen_url_configured",
            "registered_at",
            "last_seen_at",
            "is_alive",
            "policy_version",
            "request_rate",
            "stats",
        ]
        read_only_fields = fields


class RouterSampleSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = RouterStatsSample
        fields = ["received_at", "request_rate", "decisions", "policy_version", "serving"]


class RegisterSerializer(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", max_length=100)
    version = serializers.CharField(max_length=64, allow_blank=True, required=False, default="")
    listen_url = serializers.CharField(max_length=255, allow_blank=True, required=False, default="")


class StatsSerializer(serializers.Serializer):  # type: ignore[type-arg]
    policy_version = serializers.IntegerField(  # a PositiveIntegerField column
        min_value=0, max_value=2**31 - 1, required=False, allow_null=True, default=None
    )
    uptime_seconds = serializers.FloatField(min_value=0, required=False, default=0.0)
    requests_total = serializers.IntegerField(min_value=0, required=False, default=0)
    request_rate = serializers.FloatField(min_value=0, required=False, default=0.0)
    decisions = serializers.DictField(
        child=serializers.IntegerField(min_value=0), required=False, default=dict
    )
    outcomes = serializers.DictField(
        child=serializers.IntegerField(min_value=0), required=False, default=dict
    )
    ttft_p50_ms = serializers.FloatField(min_value=0, required=False, allow_null=True, default=None)
    ttft_p99_ms = serializers.FloatField(min_value=0, required=False, allow_null=True, default=None)
    backend_errors = serializers.IntegerField(min_value=0, required=False, default=0)
    fallbacks = serializers.IntegerField(min_value=0, required=False, default=0)
    # Since the previous report; common/serving.py holds the shape and its one validator.
    serving = serializers.JSONField(required=False, default=dict)

    def validate_serving(self, value: object) -> dict[str, object]:
        try:
            return clean_serving(value)
        except ServingError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate_decisions(self, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(value) - set(DECISIONS))
        if unknown:
            raise serializers.ValidationError(
                f"unknown decision {unknown[0]!r}; known: {', '.join(DECISIONS)}"
            )
        return value
