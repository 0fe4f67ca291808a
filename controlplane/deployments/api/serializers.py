from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from controlplane.deployments.choices import (
    CommandAction,
    CommandOutcome,
    ContainerHealth,
    ContainerStatus,
    EngineRole,
)
from controlplane.deployments.masking import hide_env, hide_spec_env, may_see_env
from controlplane.deployments.models import (
    AgentCommand,
    ContainerInstance,
    Deployment,
    DeploymentEvent,
    DeploymentProfile,
)


class ProfileSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = DeploymentProfile
        fields = "__all__"
        extra_kwargs = {
            "cpu_kv_cache_space_gb": {
                "error_messages": {
                    "invalid": "must be a whole number of GiB (vLLM reads "
                    "VLLM_CPU_KVCACHE_SPACE with int())"
                }
            }
        }

    def to_representation(self, instance: DeploymentProfile) -> dict[str, Any]:
        """The values of ``gpu_env``/``cpu_env`` (where a Hugging Face token sits) only for
        people who may change profiles; others see the names with ``<hidden>`` values."""
        data = super().to_representation(instance)
        if not may_see_env(getattr(self.context.get("request"), "user", None)):
            for field in ("gpu_env", "cpu_env"):
                data[field] = hide_env(data.get(field) or {})
        return data

    def to_internal_value(self, data: Any) -> Any:
        # The field's old name, now the policy knob's alone: refused by name rather than
        # ignored (a profile would silently keep its old engine limit).
        if isinstance(data, Mapping) and "cpu_max_batch_size" in data:
            raise serializers.ValidationError(
                {
                    "cpu_max_batch_size": [
                        "a profile sets the CPU engine's limit as cpu_max_num_seqs; "
                        "cpu_max_batch_size is the scheduling policy's knob"
                    ]
                }
            )
        return super().to_internal_value(data)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # Model.clean() holds the single-row rules; run it on the merged state.
        instance = DeploymentProfile(**{**self._current(), **attrs})
        try:
            instance.clean()
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None
        return attrs

    def _current(self) -> dict[str, Any]:
        if self.instance is None:
            return {}
        return {
            f.name: getattr(self.instance, f.name)
            for f in DeploymentProfile._meta.concrete_fields
            if f.name not in ("id", "created_at", "updated_at")
        }


class DeploymentEventSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = DeploymentEvent
        fields = ["id", "created_at", "generation", "step", "level", "message", "detail"]


class ContainerSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = ContainerInstance
        fields = [
            "id",
            "deployment",
            "role",
            "generation",
            "engine_id",
            "name",
            "status",
            "health",
            "exit_code",
            "endpoint",
            "updated_at",
        ]
        read_only_fields = fields


class DeploymentSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    containers = serializers.SerializerMethodField()
    # Empty until the engine runs: documented as text, not as a URI that "" would violate.
    gpu_endpoint = serializers.CharField(read_only=True)
    cpu_endpoint = serializers.CharField(read_only=True)
    start = serializers.BooleanField(write_only=True, required=False, default=False)
    accelerators = serializers.SerializerMethodField(
        help_text="UUIDs of the cards the deployment holds while it is active"
    )

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "profile",
            "node",
            "pinned",
            "accelerator_kind",
            "min_device_memory_gb",
            "cpu_cores",
            "cpu_numa_local",
            "node_selector",
            "accelerators",
            "replicas",
            "replica_of",
            "replica_index",
            "policy",
            "desired_state",
            "state",
            "state_reason",
            "state_changed_at",
            "generation",
            "step",
            "gpu_endpoint",
            "cpu_endpoint",
            "affinity_plan",
            "containers",
            "created_at",
            "updated_at",
            "start",
        ]
        read_only_fields = [
            "pinned",
            "replica_of",
            "replica_index",
            "desired_state",
            "state",
            "state_reason",
            "state_changed_at",
            "generation",
            "step",
            "gpu_endpoint",
            "cpu_endpoint",
            "affinity_plan",
            "created_at",
            "updated_at",
        ]

        extra_kwargs = {
            # Left out on create: the control plane places the deployment (docs/lifecycles.md).
            "node": {"required": False},
        }

    def validate_node_selector(self, value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 63 and len(v) <= 255
            for k, v in value.items()
        ):
            raise serializers.ValidationError(
                "must map label names (at most 63 characters) to string values (at most 255)"
            )
        if len(value) > 32:
            raise serializers.ValidationError(f"at most 32 labels, got {len(value)}")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # Moving a deployment that has engines would strand them on the old node.
        instance = self.instance
        if instance is not None and instance.state not in ("stopped", "pending", "failed"):
            for field in ("node", "profile"):
                if field in attrs and attrs[field] != getattr(instance, field):
                    refused: dict[str, str] = {
                        field: f"stop the deployment first (it is {instance.state})"
                    }
                    raise serializers.ValidationError(refused)
        if instance is not None and "node" in attrs:
            attrs["pinned"] = True  # an operator who names the node pins it there
        if instance is not None and instance.replica_of_id is not None:
            changed = sorted(k for k in attrs if getattr(instance, k, None) != attrs[k])
            if changed:
                raise serializers.ValidationError(
                    {changed[0]: "a replica follows its first replica: change that one"}
                )
        return attrs

    def get_accelerators(self, obj: Deployment) -> list[str]:
        return [c.accelerator.uuid for c in obj.accelerator_claims.all()]

    def get_containers(self, obj: Deployment) -> list[dict[str, Any]]:
        current = [c for c in obj.containers.all() if c.generation == obj.generation]
        return list(ContainerSerializer(current, many=True).data)


# Column limits: a number past them made the database refuse the statement (a 500).
MAX_ID = 2**63 - 1  # BigAutoField
MAX_INT = 2**31 - 1  # IntegerField


class ContainerStateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    deployment_id = serializers.IntegerField(min_value=1, max_value=MAX_ID)
    generation = serializers.IntegerField(min_value=0, max_value=MAX_INT)
    role = serializers.ChoiceField(choices=EngineRole.choices)
    engine_id = serializers.CharField(max_length=128, allow_blank=True, required=False, default="")
    name = serializers.CharField(max_length=128, allow_blank=True, required=False, default="")
    status = serializers.ChoiceField(choices=ContainerStatus.choices)
    health = serializers.ChoiceField(
        choices=ContainerHealth.choices, required=False, default="unknown"
    )
    exit_code = serializers.IntegerField(
        min_value=-MAX_INT - 1, max_value=MAX_INT, required=False, allow_null=True, default=None
    )
    endpoint = serializers.CharField(max_length=255, allow_blank=True, required=False, default="")


class ContainerReportSerializer(serializers.Serializer):  # type: ignore[type-arg]
    # many=True hands max_length to the ListSerializer (the stubs do not know it).
    containers = ContainerStateSerializer(many=True, max_length=1000)  # type: ignore[call-arg]


class CommandResultSerializer(serializers.Serializer):  # type: ignore[type-arg]
    status = serializers.ChoiceField(choices=CommandOutcome.choices)
    detail = serializers.CharField(allow_blank=True, required=False, default="", max_length=20000)
    containers = ContainerStateSerializer(  # type: ignore[call-arg]
        many=True, required=False, default=list, max_length=1000
    )
    output = serializers.DictField(required=False, default=dict)


class CommandFetchSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """The query of ``GET agent/commands``."""

    session = serializers.RegexField(
        r"^[A-Za-z0-9_-]+$",
        max_length=64,
        help_text="the agent process's own id: a command is handed to a session once",
    )
    wait = serializers.FloatField(
        required=False,
        default=0.0,
        min_value=0.0,
        max_value=60.0,
        help_text="seconds to wait for a command when none is queued (capped by the control "
        "plane's AGENT_COMMAND_WAIT_SECONDS)",
    )


class CommandMessageSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """One command as its agent receives it."""

    dispatch_id = serializers.UUIDField()
    node = serializers.CharField()
    action = serializers.ChoiceField(choices=CommandAction.choices)
    deployment_id = serializers.IntegerField(allow_null=True)
    generation = serializers.IntegerField()
    role = serializers.ChoiceField(choices=EngineRole.choices, allow_null=True)
    spec = serializers.DictField()
    attempt = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    traceparent = serializers.CharField(
        required=False,
        help_text="the W3C trace context of the work that issued it, when the control plane "
        "traces; the agent's span for the command continues it (docs/tracing.md)",
    )


class CommandBatchSerializer(serializers.Serializer):  # type: ignore[type-arg]
    commands = CommandMessageSerializer(many=True)


class AgentCommandSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = AgentCommand
        fields = [
            "dispatch_id",
            "node",
            "deployment",
            "action",
            "role",
            "generation",
            "step",
            "attempts",
            "delivered_at",
            "spec",
            "status",
            "detail",
            "output",
            "created_at",
            "completed_at",
        ]
        read_only_fields = fields

    def to_representation(self, instance: AgentCommand) -> dict[str, Any]:
        """The spec's env values (the profile's, where a token sits) only for people who may
        change profiles. Agents get theirs from ``agent/commands``, which is not this."""
        data = super().to_representation(instance)
        if not may_see_env(getattr(self.context.get("request"), "user", None)):
            data["spec"] = hide_spec_env(data.get("spec"))
        return data
