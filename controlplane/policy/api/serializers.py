from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.policy.models import KNOB_NAMES, PolicyRevision, SchedulingPolicy


class PolicySerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    reason = serializers.CharField(write_only=True, max_length=2000)

    class Meta:
        model = SchedulingPolicy
        fields = [
            "id",
            "name",
            "description",
            "version",
            *KNOB_NAMES,
            "reason",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["version", "created_at", "updated_at"]


class PolicyChangeSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """A change: any subset of knobs plus a mandatory reason. Values are checked by
    ``common.policy_schema`` in the service, which names the knob and its limit."""

    reason = serializers.CharField(max_length=2000)
    knobs = serializers.DictField(child=serializers.JSONField(), allow_empty=False)


class RollbackSerializer(serializers.Serializer):  # type: ignore[type-arg]
    version = serializers.IntegerField(min_value=1, max_value=2**31 - 1)
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")


class PolicyRevisionSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    created_by = serializers.SerializerMethodField()

    class Meta:
        model = PolicyRevision
        fields = [
            "version",
            "knobs",
            "changed",
            "reason",
            "created_at",
            "created_by",
            "rolled_back_to",
        ]

    def get_created_by(self, obj: PolicyRevision) -> str:
        return obj.created_by.get_username() if obj.created_by else obj.created_by_label


def routing_payload(policy: SchedulingPolicy) -> dict[str, Any]:
    return {
        "name": policy.name,
        "version": policy.version,
        "updated_at": policy.updated_at.isoformat(),
        "knobs": policy.knobs(),
    }
