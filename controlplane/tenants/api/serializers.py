from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.tenants.choices import REJECT_REASONS, USAGE_WINDOWS
from controlplane.tenants.models import MAX_MODEL_NAME, MAX_MODELS, Tenant, TenantKey


class TenantSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """A tenant's settings. Each field's type is checked here; the tenant's rules (a known
    class, the default among them, the name's form) by ``services.save_tenant``, which names
    every field it refuses at once."""

    models = serializers.ListField(
        child=serializers.CharField(max_length=MAX_MODEL_NAME, trim_whitespace=False),
        max_length=MAX_MODELS,
        required=False,
        help_text="served model names it may use; empty: every model",
    )
    classes = serializers.ListField(
        child=serializers.CharField(max_length=32),
        max_length=8,
        required=False,
        help_text="SLO classes it may use",
    )
    default_class = serializers.CharField(max_length=16, required=False)
    # Integers here; their ranges are the service's, so a bad limit is named beside every
    # other bad field in one answer.
    rpm_limit = serializers.IntegerField(required=False, help_text="requests a minute; 0: none")
    tpm_limit = serializers.IntegerField(required=False, help_text="tokens a minute; 0: none")
    active_keys = serializers.SerializerMethodField()

    class Meta:
        model = Tenant
        fields = [
            "id",
            "name",
            "description",
            "active",
            "rpm_limit",
            "tpm_limit",
            "models",
            "classes",
            "default_class",
            "active_keys",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]
        # The service judges the name (form, reserved, taken) with the other rules.
        extra_kwargs: dict[str, dict[str, Any]] = {"name": {"validators": []}}

    def get_active_keys(self, obj: Tenant) -> int:
        count = getattr(obj, "active_key_count", None)  # the viewset's annotation
        return int(count) if count is not None else obj.keys.filter(revoked_at=None).count()


class TenantKeySerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """A key as lists show it: never the key, only its first characters."""

    created_by = serializers.SerializerMethodField()
    active = serializers.BooleanField(read_only=True)

    class Meta:
        model = TenantKey
        fields = ["id", "prefix", "label", "created_at", "created_by", "revoked_at", "active"]
        read_only_fields = fields

    def get_created_by(self, obj: TenantKey) -> str:
        return obj.created_by.get_username() if obj.created_by else obj.created_by_label


class IssuedKeySerializer(TenantKeySerializer):
    """The answer to issuing a key: the only time the key itself is shown."""

    key = serializers.CharField(read_only=True, help_text="shown once; only its hash is kept")

    class Meta(TenantKeySerializer.Meta):
        fields = [*TenantKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class IssueKeySerializer(serializers.Serializer):  # type: ignore[type-arg]
    # The stubs type Field's own ``label`` (its display name); this one is the key's.
    label = serializers.CharField(  # type: ignore[assignment]
        max_length=100, required=False, allow_blank=True, default=""
    )


class UsageCountsSerializer(serializers.Serializer):  # type: ignore[type-arg]
    requests = serializers.IntegerField(min_value=0)
    prompt_tokens = serializers.IntegerField(min_value=0)
    completion_tokens = serializers.IntegerField(min_value=0)
    rejected = serializers.DictField(
        child=serializers.IntegerField(min_value=0),
        help_text=f"refusals by reason, of {', '.join(REJECT_REASONS)}",
    )


class UsageMinuteSerializer(UsageCountsSerializer):
    minute = serializers.DateTimeField()


class UsageSeriesSerializer(serializers.Serializer):  # type: ignore[type-arg]
    tenant = serializers.CharField()
    window = serializers.ChoiceField(choices=list(USAGE_WINDOWS))
    minutes = UsageMinuteSerializer(many=True)
    totals = UsageCountsSerializer()


class UsageReportSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """A router's usage report, for the schema; ``usage.parse_report`` validates it and names
    the field it refuses by its path (``tenants.acme.rejected.rpm``)."""

    tenants = serializers.DictField(
        child=UsageCountsSerializer(), help_text="deltas since the last accepted report, by name"
    )


class UsageAcceptedSerializer(serializers.Serializer):  # type: ignore[type-arg]
    accepted = serializers.ListField(child=serializers.CharField())
    dropped = serializers.ListField(
        child=serializers.CharField(), help_text="tenants the control plane does not know"
    )


def series_payload(tenant: Tenant, window: str, series: list[Any], totals: Any) -> dict[str, Any]:
    return {
        "tenant": tenant.name,
        "window": window,
        "minutes": [{"minute": minute.isoformat(), **usage.as_dict()} for minute, usage in series],
        "totals": totals.as_dict(),
    }
