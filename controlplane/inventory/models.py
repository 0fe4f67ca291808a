from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from common.hosts import HostError, check_host, is_host
from controlplane.core.models import TimeStampedModel
from controlplane.inventory.choices import AcceleratorKind, NodeStatus
from controlplane.inventory.cpulist import parse_cpu_list

node_name_validator = RegexValidator(
    r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
    "use lower-case letters, digits and '-', starting and ending with a letter or digit",
)

# Where a node that reported no address runs its engines: one machine (``syshax up``).
LOOPBACK = "127.0.0.1"


def validate_node_address(value: str) -> None:
    """A node's address is a host name or an IP literal: routers and benchmarks send traffic
    to ``http://<address>:<port>`` (common/hosts.py)."""
    try:
        check_host(value)
    except HostError as exc:
        raise ValidationError(str(exc), code="invalid_address") from None


def engine_host(address: str) -> str:
    """The host a node with ``address`` runs its engines on and is reached at. An address that
    is not a host (stored before addresses were checked; migration 0004 blanks those) is
    never used: the node counts as one that reported none."""
    return address if address and is_host(address) else LOOPBACK


class Node(TimeStampedModel):
    """A server with CPUs and (usually) accelerators, managed by one agent."""

    name = models.CharField(max_length=63, unique=True, validators=[node_name_validator])
    address = models.CharField(
        max_length=255,
        blank=True,
        validators=[validate_node_address],
        help_text="host name or IP address the router uses to reach its engines",
    )
    hostname = models.CharField(max_length=255, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    status = models.CharField(
        max_length=16, choices=NodeStatus.choices, default=NodeStatus.PENDING, db_index=True
    )
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)
    inventory_hash = models.CharField(max_length=64, blank=True)
    inventory_updated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def heartbeat_grace() -> timedelta:
        return timedelta(seconds=settings.HEARTBEAT_INTERVAL_SECONDS * settings.HEARTBEAT_TOLERANCE)

    def is_alive(self, now: datetime | None = None) -> bool:
        if self.last_heartbeat_at is None:
            return False
        now = now or timezone.now()
        return now - self.last_heartbeat_at <= self.heartbeat_grace()

    @property
    def engine_host(self) -> str:
        return engine_host(self.address)

    def core_ids(self) -> list[int]:
        cpus: set[int] = set()
        for numa in self.numa_nodes.all():
            cpus.update(parse_cpu_list(numa.cpus))
        return sorted(cpus)


class CpuTopology(models.Model):
    node = models.OneToOneField(Node, on_delete=models.CASCADE, related_name="cpu")
    model_name = models.CharField(max_length=255, blank=True)
    architecture = models.CharField(max_length=32, blank=True)
    sockets = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    physical_cores = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    threads = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    isa_flags = models.JSONField(
        default=list, blank=True, help_text="asimd, sve, i8mm, avx2, avx512*, amx*"
    )
    memory_total_bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        verbose_name = "CPU topology"
        verbose_name_plural = "CPU topologies"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(threads__gte=models.F("physical_cores")),
                name="cpu_threads_at_least_cores",
            )
        ]

    def __str__(self) -> str:
        return f"{self.node}: {self.model_name} ({self.physical_cores} cores)"


class NumaNode(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="numa_nodes")
    index = models.PositiveIntegerField()
    cpus = models.CharField(max_length=4096, help_text="Linux CPU list, e.g. 0-39")
    memory_total_bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["node", "index"]
        verbose_name = "NUMA node"
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="numa_unique_index_per_node")
        ]

    def __str__(self) -> str:
        return f"{self.node} NUMA{self.index} ({self.cpus})"

    @property
    def cpu_count(self) -> int:
        return len(parse_cpu_list(self.cpus))


class Accelerator(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="accelerators")
    kind = models.CharField(max_length=8, choices=AcceleratorKind.choices)
    vendor = models.CharField(max_length=64, blank=True)
    model_name = models.CharField(max_length=128, blank=True)
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=128)
    memory_total_bytes = models.PositiveBigIntegerField(default=0)
    memory_used_bytes = models.PositiveBigIntegerField(default=0)
    utilization_percent = models.FloatField(
        default=0.0, validators=[MinValueValidator(0), MaxValueValidator(100)]
    )
    temperature_c = models.FloatField(null=True, blank=True)
    simulated = models.BooleanField(
        default=False, help_text="declared by the agent's config for demos and tests; not hardware"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node", "index"]
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="accelerator_unique_index"),
            models.UniqueConstraint(fields=["node", "uuid"], name="accelerator_unique_uuid"),
        ]

    def __str__(self) -> str:
        prefix = "simulated " if self.simulated else ""
        return f"{self.node} {self.kind}{self.index}: {prefix}{self.model_name}"

    @property
    def memory_total_gb(self) -> float:
        return self.memory_total_bytes / 1024**3


class Heartbeat(models.Model):
    """One small row per heartbeat; pruned after HEARTBEAT_RETENTION_HOURS."""

    # No index of its own: ``heartbeat_node_time_idx`` leads with the node and serves every
    # lookup by node (and the cascade), so a second one only cost each insert
    # (docs/decisions/0036-group-commits-one-statement.md).
    node = models.ForeignKey(
        Node, on_delete=models.CASCADE, related_name="heartbeats", db_index=False
    )
    received_at = models.DateTimeField(default=timezone.now)
    cpu_percent = models.FloatField(default=0.0)
    memory_used_bytes = models.PositiveBigIntegerField(default=0)
    memory_total_bytes = models.PositiveBigIntegerField(default=0)
    accelerators = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-received_at"]
        indexes = [models.Index(fields=["node", "-received_at"], name="heartbeat_node_time_idx")]

    def __str__(self) -> str:
        return f"{self.node} @ {self.received_at:%Y-%m-%d %H:%M:%S}"
