from django.db import models

from common.decisions import Mode, ReplicaChoice


class PolicyMode(models.TextChoices):
    """The policy's modes (``common.decisions.Mode``, the router's), with their labels."""

    AUTO = Mode.AUTO.value, "auto (hetero: decide per request)"
    GPU_ONLY = Mode.GPU_ONLY.value, "GPU only"
    CPU_ONLY = Mode.CPU_ONLY.value, "CPU only"
    FORCED_PD = Mode.FORCED_PD.value, "forced PD (GPU prefill, CPU decode)"


class DeciderAlgorithm(models.TextChoices):
    CAPACITY = "capacity", "capacity-aware"
    SYSHAX_THRESHOLD = "syshax-threshold", "sysHAX threshold decider"


class ReplicaPicker(models.TextChoices):
    """The policy's ``replica_choice`` (``common.decisions.ReplicaChoice``), with labels."""

    LEAST_LOADED = ReplicaChoice.LEAST_LOADED.value, "least loaded"
    PREFIX = ReplicaChoice.PREFIX.value, "prefix-aware (within a load slack)"


class PolicyAuditAction(models.TextChoices):
    """The audit rows' actions on scheduling policies (``AuditEntry.action``)."""

    POLICY_CREATED = "policy.created"
    POLICY_CHANGED = "policy.changed"
    POLICY_DELETED = "policy.deleted"
