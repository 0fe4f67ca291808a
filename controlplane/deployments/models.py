from __future__ import annotations

import math
import uuid
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from common.model_card import ModelCardError, read_model_card
from common.tracing import TracingError, checked_endpoint
from controlplane.core.models import TimeStampedModel
from controlplane.deployments.choices import (
    DEPLOYMENT_LIFECYCLE,
    AffinityMode,
    CommandAction,
    CommandStatus,
    ContainerHealth,
    ContainerStatus,
    DeploymentState,
    DesiredState,
    EngineKind,
    EngineRole,
    EventLevel,
    PdProtocol,
    PreemptionMode,
    Quantization,
    StepName,
    TraceDetail,
)
from controlplane.inventory.choices import AcceleratorKind
from controlplane.inventory.cpulist import CpuListError, parse_cpu_list
from controlplane.inventory.models import Node, node_name_validator
from controlplane.policy.models import SchedulingPolicy

# Of the GPU container's /dev/shm, what the KV arena leaves to vLLM's own shared memory.
KV_ARENA_SHM_RESERVE_MIB = 512

port_validators = [MinValueValidator(1), MaxValueValidator(65535)]


# Names the dashboard's profile pages use for themselves (/profiles/new/).
RESERVED_PROFILE_NAMES = frozenset({"new"})


class DeploymentProfile(TimeStampedModel):
    """Every knob of a GPU + CPU engine pair, independent of the node it lands on."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.TextField(blank=True)
    model = models.CharField(max_length=255, help_text="model path or hub id the engines load")
    served_model_name = models.CharField(
        max_length=255, blank=True, help_text="name clients use; defaults to the model"
    )
    quantization = models.CharField(
        max_length=8, choices=Quantization.choices, default=Quantization.NONE
    )
    engine = models.CharField(max_length=16, choices=EngineKind.choices, default=EngineKind.VLLM)
    pd_protocol = models.CharField(
        max_length=8,
        choices=PdProtocol.choices,
        default=PdProtocol.VLLM,
        help_text="how the router hands a prefilled request to the CPU engine",
    )
    sim_gpu_device = models.CharField(
        max_length=64, default="a100-80gb", help_text="simulator engines: GPU/NPU device preset"
    )
    sim_cpu_device = models.CharField(
        max_length=64, default="kunpeng-920-7280z", help_text="simulator engines: CPU preset"
    )
    enable_cpu_engine = models.BooleanField(
        default=True, help_text="run the CPU decode engine beside the GPU one"
    )

    gpu_image = models.CharField(max_length=255, default="vllm/vllm-openai:latest")
    gpu_command = models.JSONField(
        default=list, blank=True, help_text="argv prefix; empty: image default"
    )
    gpu_extra_args = models.JSONField(default=list, blank=True)
    gpu_env = models.JSONField(default=dict, blank=True)
    gpu_port = models.PositiveIntegerField(default=7001, validators=port_validators)
    tensor_parallel_size = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(64)]
    )
    gpu_memory_utilization = models.FloatField(
        default=0.8, help_text="fraction of device memory vLLM may use, in (0, 1]; 0.8 recommended"
    )
    max_model_len = models.PositiveIntegerField(
        default=8192,
        null=True,
        blank=True,
        validators=[MinValueValidator(16), MaxValueValidator(1048576)],
        help_text="context length the engines serve; empty: the model's own, as vLLM derives "
        "it from config.json. Checked against the model when its directory is readable here",
    )
    max_num_seqs = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1), MaxValueValidator(65536)]
    )
    preemption_mode = models.CharField(
        max_length=10,
        choices=PreemptionMode.choices,
        default=PreemptionMode.SWAP,
        help_text="sysHAX's V0 engine (and the simulator in its sysHAX mode) only; "
        "upstream vLLM V1 always recomputes and has no such flag",
    )
    gpu_shm_size_gb = models.FloatField(
        default=16.0,
        validators=[MinValueValidator(0.0625), MaxValueValidator(65536.0)],
        help_text="/dev/shm for KV handoff",
    )
    kv_arena_mib = models.PositiveIntegerField(
        default=2048,
        validators=[MinValueValidator(0), MaxValueValidator(1048576)],
        help_text="the GPU engine's KV connector arena in /dev/shm (pinned, reserved at start); "
        "a PD prefill that does not fit is decoded on the GPU and counted",
    )

    cpu_image = models.CharField(max_length=255, default="vllm/vllm-cpu:latest")
    cpu_command = models.JSONField(default=list, blank=True)
    cpu_extra_args = models.JSONField(default=list, blank=True)
    cpu_env = models.JSONField(default=dict, blank=True)
    cpu_port = models.PositiveIntegerField(default=7002, validators=port_validators)
    # The CPU engine's own --max-num-seqs. Not the policy's cpu_max_batch_size (how many
    # decodes the router sends the CPU): the router admits the smaller of the two.
    cpu_max_num_seqs = models.PositiveIntegerField(
        default=8,
        validators=[MinValueValidator(1), MaxValueValidator(4096)],
        help_text="the CPU engine's --max-num-seqs; the router admits at most this many decodes",
    )
    omp_num_threads = models.PositiveIntegerField(
        null=True, blank=True, help_text="empty: planned from the cores (1-1.5x physical cores)"
    )
    cpu_affinity_mode = models.CharField(
        max_length=8, choices=AffinityMode.choices, default=AffinityMode.AUTO
    )
    cpu_affinity = models.CharField(
        max_length=4096, blank=True, help_text="explicit CPU list, e.g. 0-39,40-79"
    )
    cpu_kv_cache_space_gb = models.PositiveIntegerField(
        default=40,
        validators=[MinValueValidator(1)],
        help_text="VLLM_CPU_KVCACHE_SPACE: whole GiB (vLLM reads it with int())",
    )
    cpu_memory_limit_gb = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(1.0)]
    )
    health_timeout_seconds = models.FloatField(
        default=600.0, validators=[MinValueValidator(1.0), MaxValueValidator(7200.0)]
    )
    # Request tracing (docs/tracing.md): both engines send their spans to this collector.
    otlp_traces_endpoint = models.CharField(
        max_length=1024,
        blank=True,
        help_text="an OTLP/HTTP collector's URL (http://collector:4318/v1/traces): both "
        "engines trace their requests to it (--otlp-traces-endpoint); empty: no tracing",
    )
    trace_detail = models.CharField(
        max_length=8,
        choices=TraceDetail.choices,
        default=TraceDetail.NONE,
        help_text="vLLM engines: their costly per-step timings on the request's span "
        "(--collect-detailed-traces)",
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(gpu_memory_utilization__gt=0, gpu_memory_utilization__lte=1),
                name="profile_gpu_memory_utilization_range",
            ),
            models.CheckConstraint(
                condition=~models.Q(gpu_port=models.F("cpu_port")),
                name="profile_distinct_ports",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def model_name_for_clients(self) -> str:
        return self.served_model_name or self.model

    @property
    def speaks_syshax(self) -> bool:
        """The engines take sysHAX's V0 flags (``--preemption-mode``) and request fields: its
        patched image, or the simulator in its sysHAX-compatible mode (chosen by the protocol)."""
        return self.engine == EngineKind.SYSHAX_V0 or (
            self.engine == EngineKind.SIMULATOR and self.pd_protocol == PdProtocol.SYSHAX
        )

    @property
    def uses_kv_connector(self) -> bool:
        """Both engines load the syshax KV connector (``--kv-transfer-config``)."""
        return (
            self.enable_cpu_engine
            and self.pd_protocol == PdProtocol.VLLM
            and self.engine in (EngineKind.VLLM, EngineKind.SIMULATOR)
        )

    def _model_errors(self) -> dict[str, str]:
        """The model's own limits, when its directory is one this host can read: a directory
        without a config.json, or a max_model_len over the model's. A path that is not here
        may be on the nodes: their agents check it before an engine starts."""
        if self.engine != EngineKind.VLLM or not self.model.startswith("/"):
            return {}
        path = Path(self.model)
        if not path.exists():
            return {}
        try:
            read_model_card(path).check_max_model_len(self.max_model_len)
        except ModelCardError as exc:
            return {exc.field: exc.reason}
        return {}

    def _tracing_errors(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        if self.otlp_traces_endpoint:
            try:
                checked_endpoint(self.otlp_traces_endpoint, "otlp_traces_endpoint")
            except TracingError as exc:
                errors["otlp_traces_endpoint"] = str(exc)
        if self.trace_detail != TraceDetail.NONE:
            if self.engine == EngineKind.SIMULATOR:
                errors["trace_detail"] = "vLLM engines only: the simulator has no such timings"
            elif not self.otlp_traces_endpoint:
                errors["trace_detail"] = "needs otlp_traces_endpoint (where the spans go)"
        return errors

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.name in RESERVED_PROFILE_NAMES:
            errors["name"] = f"{self.name!r} is reserved (the dashboard's /profiles/{self.name}/)"
        if not 0 < self.gpu_memory_utilization <= 1:
            errors["gpu_memory_utilization"] = (
                f"must be in (0, 1]; got {self.gpu_memory_utilization:g}"
            )
        if self.gpu_port == self.cpu_port:
            errors["cpu_port"] = f"must differ from gpu_port ({self.gpu_port})"
        errors.update(self._model_errors())
        if self.cpu_affinity_mode == AffinityMode.EXPLICIT:
            if not self.cpu_affinity:
                errors["cpu_affinity"] = "is required when cpu_affinity_mode is explicit"
            else:
                try:
                    parse_cpu_list(self.cpu_affinity)
                except CpuListError as exc:
                    errors["cpu_affinity"] = str(exc)
        if self.pd_protocol == PdProtocol.SYSHAX and self.engine == EngineKind.VLLM:
            errors["pd_protocol"] = (
                '"syshax" needs an engine that speaks sysHAX\'s fields (syshax-v0 or simulator); '
                "upstream vLLM ignores them"
            )
        elif self.pd_protocol == PdProtocol.VLLM and self.engine == EngineKind.SYSHAX_V0:
            errors["pd_protocol"] = (
                '"vllm" needs an engine that loads the syshax KV connector (vllm or simulator); '
                'sysHAX\'s patched V0 image hands KV over with its own fields: use "syshax"'
            )
        # The arena lives in the GPU container's /dev/shm beside vLLM's own use of it (a
        # simulator's segments are sparse files: it needs no room).
        shm_gb, arena = self.gpu_shm_size_gb, self.kv_arena_mib
        if (
            self.uses_kv_connector
            and self.engine == EngineKind.VLLM
            and isinstance(shm_gb, int | float)
            and isinstance(arena, int)
            and math.isfinite(shm_gb)
            and arena > shm_gb * 1024 - KV_ARENA_SHM_RESERVE_MIB
        ):
            room = max(0, int(shm_gb * 1024) - KV_ARENA_SHM_RESERVE_MIB)
            errors["kv_arena_mib"] = (
                f"must fit the GPU container's /dev/shm (gpu_shm_size_gb {shm_gb:g} GiB, less "
                f"{KV_ARENA_SHM_RESERVE_MIB} MiB for vLLM): at most {room} MiB; got {arena}"
            )
        errors.update(self._tracing_errors())
        for field in ("gpu_command", "cpu_command", "gpu_extra_args", "cpu_extra_args"):
            value = getattr(self, field)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                errors[field] = "must be a list of strings"
        for field in ("gpu_env", "cpu_env"):
            value = getattr(self, field)
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                errors[field] = "must map names to string values"
        if errors:
            raise ValidationError(errors)


class Deployment(TimeStampedModel):
    """A profile placed on a node. The row is the source of truth for the deploy workflow."""

    name = models.CharField(max_length=63, unique=True, validators=[node_name_validator])
    profile = models.ForeignKey(
        DeploymentProfile, on_delete=models.PROTECT, related_name="deployments"
    )
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="deployments")
    # Placement (docs/lifecycles.md): pinned to `node` by its operator, or placed (and placed
    # again when its node is lost) by the control plane within these constraints.
    pinned = models.BooleanField(
        default=True, help_text="the operator chose the node; false: the control plane places it"
    )
    accelerator_kind = models.CharField(
        max_length=8, choices=AcceleratorKind.choices, blank=True, help_text="empty: any kind"
    )
    min_device_memory_gb = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0), MaxValueValidator(1e6)],
        help_text="each card needs at least this much memory",
    )
    cpu_cores = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(65536)],
        help_text="physical cores for the CPU engine; empty: every free core of the node",
    )
    cpu_numa_local = models.BooleanField(
        default=False, help_text="the CPU engine's cores on one NUMA node (else spread evenly)"
    )
    node_selector = models.JSONField(
        default=dict, blank=True, help_text="node labels the node must carry, e.g. {rack: r1}"
    )
    # Replicas: each one a GPU engine and its CPU engine on one node. Replicas 2..N are
    # deployments of their own (placed by the control plane, spread over nodes) that follow
    # their first replica's deploys and stops.
    replicas = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text="engine pairs to run, each on a node of its own where there is room",
    )
    replica_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="replica_set",
        help_text="the first replica this one follows",
    )
    replica_index = models.PositiveIntegerField(default=1)
    retiring = models.BooleanField(
        default=False, help_text="a replica beyond the count: removed once stopped"
    )
    policy = models.ForeignKey(
        SchedulingPolicy,
        on_delete=models.PROTECT,
        related_name="deployments",
        null=True,
        blank=True,
    )
    desired_state = models.CharField(
        max_length=8, choices=DesiredState.choices, default=DesiredState.STOPPED
    )
    state = models.CharField(
        max_length=10,
        choices=DeploymentState.choices,
        default=DeploymentState.PENDING,
        db_index=True,
    )
    state_reason = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(null=True, blank=True)
    generation = models.PositiveIntegerField(
        default=0, help_text="bumped by every deploy, restart and redeploy"
    )
    step = models.CharField(
        max_length=32, blank=True, choices=StepName.choices, help_text="current workflow step"
    )
    gpu_endpoint = models.URLField(blank=True)
    cpu_endpoint = models.URLField(blank=True)
    affinity_plan = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def transition(self, to: str, reason: str = "") -> None:
        """Move ``state`` to ``to`` if the state table allows it (``TransitionError`` if
        not); the caller saves."""
        DEPLOYMENT_LIFECYCLE.check(self.state, to)
        self.state = to
        self.state_reason = reason
        self.state_changed_at = timezone.now()


class AcceleratorClaim(models.Model):
    """A card held by an active deployment. One row per card: the unique key is what keeps
    two deployments, however concurrent, from taking the same card."""

    accelerator = models.OneToOneField(
        "inventory.Accelerator", on_delete=models.CASCADE, related_name="claim"
    )
    deployment = models.ForeignKey(
        Deployment, on_delete=models.CASCADE, related_name="accelerator_claims"
    )
    claimed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["accelerator__node", "accelerator__index"]

    def __str__(self) -> str:
        return f"{self.accelerator} held by {self.deployment}"


class DeploymentEvent(models.Model):
    """The deployment's timeline: one row per workflow step or observation."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    generation = models.PositiveIntegerField(default=0)
    step = models.CharField(max_length=32)
    level = models.CharField(max_length=8, choices=EventLevel.choices, default=EventLevel.INFO)
    message = models.TextField()
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["deployment", "created_at", "id"]

    def __str__(self) -> str:
        return f"{self.deployment}: {self.step} {self.message[:40]}"


class ContainerInstance(models.Model):
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="containers")
    role = models.CharField(max_length=4, choices=EngineRole.choices)
    generation = models.PositiveIntegerField()
    engine_id = models.CharField(
        max_length=128, blank=True, help_text="runtime container/process id"
    )
    name = models.CharField(max_length=128)
    status = models.CharField(
        max_length=8, choices=ContainerStatus.choices, default=ContainerStatus.CREATED
    )
    health = models.CharField(
        max_length=10, choices=ContainerHealth.choices, default=ContainerHealth.UNKNOWN
    )
    exit_code = models.IntegerField(null=True, blank=True)
    endpoint = models.CharField(max_length=255, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment", "generation", "role"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment", "role", "generation"], name="container_unique_role_generation"
            )
        ]

    def __str__(self) -> str:
        return self.name


class AgentCommand(models.Model):
    """A command sent to a node's agent. ``dispatch_id`` makes redelivery harmless."""

    dispatch_id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="commands")
    deployment = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.CASCADE, related_name="commands"
    )
    action = models.CharField(max_length=8, choices=CommandAction.choices)
    role = models.CharField(max_length=4, choices=EngineRole.choices, blank=True)
    generation = models.PositiveIntegerField(default=0)
    step = models.CharField(
        max_length=32, blank=True, choices=StepName.choices, help_text="workflow step it serves"
    )
    attempts = models.PositiveIntegerField(default=0, help_text="times handed to an agent")
    spec = models.JSONField(default=dict, blank=True)
    # The W3C trace context of the work that issued it (tracing on): the agent's span for the
    # command joins that trace (docs/tracing.md).
    traceparent = models.CharField(max_length=55, blank=True, editable=False)
    status = models.CharField(
        max_length=10, choices=CommandStatus.choices, default=CommandStatus.QUEUED, db_index=True
    )
    detail = models.TextField(blank=True)
    output = models.JSONField(default=dict, blank=True)
    # The agent session (one per agent process) it was last handed to, and when.
    delivered_to = models.CharField(max_length=64, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["node", "status", "created_at"], name="command_node_queue")]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment", "generation", "step"],
                condition=~models.Q(step=""),
                name="command_unique_step_per_generation",
            )
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.role} {self.deployment} g{self.generation}"
