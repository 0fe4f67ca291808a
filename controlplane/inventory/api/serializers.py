from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.inventory.choices import OPERATOR_NODE_MOVES, AcceleratorKind, NodeStatus
from controlplane.inventory.cpulist import CpuListError, parse_cpu_list
from controlplane.inventory.models import (
    Accelerator,
    CpuTopology,
    Heartbeat,
    Node,
    NumaNode,
    validate_node_address,
)

# The largest byte count a database column holds (a signed 64-bit integer).
MAX_BYTES = 2**63 - 1


class CpuTopologySerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = CpuTopology
        fields = [
            "model_name",
            "architecture",
            "sockets",
            "physical_cores",
            "threads",
            "isa_flags",
            "memory_total_bytes",
        ]


class NumaNodeSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = NumaNode
        fields = ["index", "cpus", "cpu_count", "memory_total_bytes"]


class AcceleratorSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    node_name = serializers.CharField(source="node.name", read_only=True)

    class Meta:
        model = Accelerator
        fields = [
            "id",
            "node",
            "node_name",
            "kind",
            "vendor",
            "model_name",
            "index",
            "uuid",
            "memory_total_bytes",
            "memory_used_bytes",
            "utilization_percent",
            "temperature_c",
            "simulated",
            "updated_at",
        ]
        read_only_fields = fields


class NodeSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    cpu = CpuTopologySerializer(read_only=True, allow_null=True)  # null until the agent reports
    numa_nodes = NumaNodeSerializer(many=True, read_only=True)
    accelerators = AcceleratorSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "address",
            "hostname",
            "labels",
            "status",
            "last_heartbeat_at",
            "agent_version",
            "inventory_hash",
            "inventory_updated_at",
            "cpu",
            "numa_nodes",
            "accelerators",
            "created_at",
            "updated_at",
        ]
        read_only_fields = [
            "hostname",
            "last_heartbeat_at",
            "agent_version",
            "inventory_hash",
            "inventory_updated_at",
            "created_at",
            "updated_at",
        ]

    def validate_labels(self, value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise serializers.ValidationError("must map label names to string values")
        return value

    def validate_status(self, value: str) -> str:
        # People may drain a node or undrain it; online and offline come from heartbeats.
        current = self.instance.status if self.instance else NodeStatus.PENDING
        if value != current and current not in OPERATOR_NODE_MOVES.get(value, frozenset()):
            raise serializers.ValidationError(
                f"cannot set {value!r} on a node that is {current}: a person may set "
                "'draining', or 'online' on a drained node; heartbeats set the rest"
            )
        return value


class HeartbeatSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = Heartbeat
        fields = [
            "received_at",
            "cpu_percent",
            "memory_used_bytes",
            "memory_total_bytes",
            "accelerators",
        ]


# --- what agents send -----------------------------------------------------------------------


class ReportedCpuSerializer(serializers.Serializer):  # type: ignore[type-arg]
    model = serializers.CharField(max_length=255, allow_blank=True, required=False, default="")
    architecture = serializers.CharField(
        max_length=32, allow_blank=True, required=False, default=""
    )
    sockets = serializers.IntegerField(min_value=1, max_value=64)
    physical_cores = serializers.IntegerField(min_value=1, max_value=65536)
    threads = serializers.IntegerField(min_value=1, max_value=131072)
    isa_flags = serializers.ListField(
        child=serializers.CharField(max_length=32), max_length=512, required=False, default=list
    )
    memory_total_bytes = serializers.IntegerField(
        min_value=0, max_value=MAX_BYTES, required=False, default=0
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["threads"] < attrs["physical_cores"]:
            raise serializers.ValidationError(
                {"threads": f"must be at least physical_cores ({attrs['physical_cores']})"}
            )
        return attrs


class ReportedNumaSerializer(serializers.Serializer):  # type: ignore[type-arg]
    index = serializers.IntegerField(min_value=0, max_value=1024)
    cpus = serializers.CharField(max_length=4096)
    memory_total_bytes = serializers.IntegerField(
        min_value=0, max_value=MAX_BYTES, required=False, default=0
    )

    def validate_cpus(self, value: str) -> str:
        try:
            parse_cpu_list(value)
        except CpuListError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value


class ReportedAcceleratorSerializer(serializers.Serializer):  # type: ignore[type-arg]
    kind = serializers.ChoiceField(choices=AcceleratorKind.choices)
    vendor = serializers.CharField(max_length=64, allow_blank=True, required=False, default="")
    model = serializers.CharField(max_length=128, allow_blank=True, required=False, default="")
    index = serializers.IntegerField(min_value=0, max_value=1024)
    uuid = serializers.CharField(max_length=128)
    memory_total_bytes = serializers.IntegerField(
        min_value=0, max_value=MAX_BYTES, required=False, default=0
    )
    simulated = serializers.BooleanField(required=False, default=False)


class InventorySerializer(serializers.Serializer):  # type: ignore[type-arg]
    agent_version = serializers.CharField(
        max_length=64, allow_blank=True, required=False, default=""
    )
    hostname = serializers.CharField(max_length=255, allow_blank=True, required=False, default="")
    address = serializers.CharField(
        max_length=255,
        allow_blank=True,
        required=False,
        default="",
        validators=[validate_node_address],
        help_text="host name or IP address (IPv6 without brackets) routers reach the engines "
        "on; blank keeps the stored one",
    )
    cpu = ReportedCpuSerializer()
    numa_nodes = ReportedNumaSerializer(many=True, required=False, default=list)
    accelerators = ReportedAcceleratorSerializer(  # type: ignore[call-arg]
        many=True,
        required=False,
        default=list,
        max_length=1024,  # ListSerializer's own limit
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        indexes = [n["index"] for n in attrs["numa_nodes"]]
        if len(indexes) != len(set(indexes)):
            raise serializers.ValidationError({"numa_nodes": "NUMA indexes must be unique"})
        uuids = [a["uuid"] for a in attrs["accelerators"]]
        if len(uuids) != len(set(uuids)):
            raise serializers.ValidationError({"accelerators": "accelerator uuids must be unique"})
        cards = [a["index"] for a in attrs["accelerators"]]
        if len(cards) != len(set(cards)):
            raise serializers.ValidationError(
                {"accelerators": "accelerator indexes must be unique on a node"}
            )
        return attrs


class AcceleratorReadingSerializer(serializers.Serializer):  # type: ignore[type-arg]
    uuid = serializers.CharField(max_length=128)
    utilization_percent = serializers.FloatField(
        min_value=0, max_value=100, required=False, default=0.0
    )
    memory_used_bytes = serializers.IntegerField(
        min_value=0, max_value=MAX_BYTES, required=False, default=0
    )
    temperature_c = serializers.FloatField(
        min_value=-50, max_value=200, required=False, allow_null=True, default=None
    )


class HeartbeatInSerializer(serializers.Serializer):  # type: ignore[type-arg]
    cpu_percent = serializers.FloatField(min_value=0, max_value=100, required=False, default=0.0)
    memory_used_bytes = serializers.IntegerField(
        min_value=0, max_value=MAX_BYTES, required=False, default=0
    )
    memory_total_bytes = serializers.IntegerField(
        min_value=0, max_value=MAX_BYTES, required=False, default=0
    )
    inventory_hash = serializers.CharField(
        max_length=64, allow_blank=True, required=False, default=""
    )
    accelerators = AcceleratorReadingSerializer(  # type: ignore[call-arg]
        many=True,
        required=False,
        default=list,
        max_length=1024,  # ListSerializer's own limit
    )
