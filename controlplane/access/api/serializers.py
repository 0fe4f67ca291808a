from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.access.choices import CredentialKind
from controlplane.access.models import MachineCredential


class CredentialSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = MachineCredential
        fields = [
            "id",
            "kind",
            "name",
            "key_hint",
            "node",
            "created_at",
            "last_used_at",
            "revoked_at",
        ]
        read_only_fields = ["key_hint", "created_at", "last_used_at", "revoked_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        kind, node = attrs.get("kind"), attrs.get("node")
        if kind == CredentialKind.AGENT and node is None:
            raise serializers.ValidationError({"node": "an agent credential needs its node"})
        if kind == CredentialKind.ROUTER and node is not None:
            raise serializers.ValidationError({"node": "a router credential has no node"})
        return attrs
