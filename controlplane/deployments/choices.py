from django.db import models

from controlplane.core.lifecycle import Lifecycle


class Quantization(models.TextChoices):
    NONE = "none", "none (model dtype)"
    Q4_0 = "q4_0", "q4_0"
    Q8_0 = "q8_0", "q8_0"
    AWQ = "awq", "AWQ"
    GPTQ = "gptq", "GPTQ"
    FP8 = "fp8", "FP8"


class TraceDetail(models.TextChoices):
    """vLLM's ``--collect-detailed-traces``: which of its costly timings go on a request's span."""

    NONE = "none", "none"
    MODEL = "model", "model (forward time)"
    WORKER = "worker", "worker (execute time)"
    ALL = "all", "all"


class PreemptionMode(models.TextChoices):
    SWAP = "swap", "swap (KV cache to host memory)"
    RECOMPUTE = "recompute", "recompute"


class AffinityMode(models.TextChoices):
    AUTO = "auto", "auto (spread over NUMA nodes)"
    EXPLICIT = "explicit", "explicit CPU list"


class EngineKind(models.TextChoices):
    VLLM = "vllm", "vLLM (upstream, V1 engine)"
    SYSHAX_V0 = "syshax-v0", "sysHAX's patched vLLM V0 image"
    SIMULATOR = "simulator", "syshax sim (simulated engine)"


class PdProtocol(models.TextChoices):
    VLLM = "vllm", "vLLM kv_transfer_params (KV through the syshax connector)"
    SYSHAX = "syshax", "sysHAX style (num_decode_tokens, generated_text, request_id_inference)"


class DesiredState(models.TextChoices):
    RUNNING = "running", "running"
    STOPPED = "stopped", "stopped"


class DeploymentState(models.TextChoices):
    PENDING = "pending", "pending"
    DEPLOYING = "deploying", "deploying"
    RUNNING = "running", "running"
    STOPPING = "stopping", "stopping"
    STOPPED = "stopped", "stopped"
    FAILED = "failed", "failed"
    UNKNOWN = "unknown", "unknown (node lost)"


_D = DeploymentState
# docs/lifecycles.md#deployment shows this table; test_lifecycles.py checks they agree.
DEPLOYMENT_LIFECYCLE = Lifecycle(
    "state",
    {
        _D.PENDING: {_D.DEPLOYING, _D.STOPPING},
        # A restart while deploying starts the next generation: deploying again.
        _D.DEPLOYING: {_D.DEPLOYING, _D.RUNNING, _D.FAILED, _D.STOPPING, _D.UNKNOWN},
        _D.RUNNING: {_D.DEPLOYING, _D.STOPPING, _D.UNKNOWN},
        _D.STOPPING: {_D.STOPPING, _D.STOPPED, _D.FAILED, _D.DEPLOYING, _D.UNKNOWN},
        _D.STOPPED: {_D.DEPLOYING, _D.STOPPING},
        _D.FAILED: {_D.DEPLOYING, _D.STOPPING, _D.UNKNOWN},
        # The node is back: settled from what its agent reports, or resumed at its step.
        _D.UNKNOWN: {_D.RUNNING, _D.STOPPED, _D.DEPLOYING, _D.STOPPING},
    },
)


class StepName(models.TextChoices):
    """The deploy workflow's steps (workflow.py), one agent command each."""

    # Between steps, or a command outside the workflow (stopping engines a moved deployment
    # left on a node that came back): a value of its own, so the API's schema lists it.
    NONE = "", "no step"
    STOP_OLD_CPU = "stop-old-cpu", "stop the previous CPU engine"
    STOP_OLD_GPU = "stop-old-gpu", "stop the previous GPU engine"
    START_GPU = "start-gpu", "start the GPU engine"
    START_CPU = "start-cpu", "start the CPU engine"
    STOP_CPU = "stop-cpu", "stop the CPU engine"
    STOP_GPU = "stop-gpu", "stop the GPU engine"
    CLEANUP_CPU = "cleanup-cpu", "remove a failed generation's CPU engine"
    CLEANUP_GPU = "cleanup-gpu", "remove a failed generation's GPU engine"


class EngineRole(models.TextChoices):
    GPU = "gpu", "GPU/NPU engine (prefill, decode)"
    CPU = "cpu", "CPU engine (decode)"


class ContainerStatus(models.TextChoices):
    CREATED = "created", "created"
    RUNNING = "running", "running"
    EXITED = "exited", "exited"
    MISSING = "missing", "missing"


class ContainerHealth(models.TextChoices):
    STARTING = "starting", "starting"
    HEALTHY = "healthy", "healthy"
    UNHEALTHY = "unhealthy", "unhealthy"
    UNKNOWN = "unknown", "unknown"


class EventLevel(models.TextChoices):
    INFO = "info", "info"
    WARNING = "warning", "warning"
    ERROR = "error", "error"


class CommandAction(models.TextChoices):
    START = "start", "start"
    STOP = "stop", "stop"
    RESTART = "restart", "restart"
    INSPECT = "inspect", "inspect"
    LOGS = "logs", "logs"


class CommandStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    EXPIRED = "expired", "expired"


_C = CommandStatus

# An agent command is queued until its one result: the agent's, or the expiry's. A result
# is a compare-and-set from the states here (workflow.record_command_result), so a repeat
# or a late result after the expiry changes nothing.
COMMAND_LIFECYCLE = Lifecycle(
    "status",
    {
        _C.QUEUED: {_C.SUCCEEDED, _C.FAILED, _C.EXPIRED},
        _C.SUCCEEDED: set(),
        _C.FAILED: set(),
        _C.EXPIRED: set(),
    },
)


class CommandOutcome(models.TextChoices):
    """What an agent may report for a command."""

    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"


# Celery task names: tasks.py registers them; services queue them by name (core.dispatch).
ADVANCE_TASK = "deployments.advance"
RESCHEDULE_TASK = "deployments.reschedule"
RECONCILE_NODE_TASK = "deployments.reconcile_node"


class DeploymentAuditAction(models.TextChoices):
    """The audit rows' actions (``AuditEntry.action``) on deployments, profiles, containers
    and agent commands. An agent command's row is ``command.<status>``, one per final status
    of ``CommandStatus``."""

    DEPLOYMENT_CREATED = "deployment.created"
    DEPLOYMENT_DEPLOY = "deployment.deploy"
    DEPLOYMENT_STOP = "deployment.stop"
    DEPLOYMENT_REPLICAS = "deployment.replicas"
    DEPLOYMENT_RESCHEDULED = "deployment.rescheduled"
    DEPLOYMENT_UNKNOWN = "deployment.unknown"
    DEPLOYMENT_DELETED = "deployment.deleted"
    PROFILE_CREATED = "profile.created"
    PROFILE_UPDATED = "profile.updated"
    PROFILE_DELETED = "profile.deleted"
    CONTAINER_STATUS = "container.status"
    COMMAND_SUCCEEDED = "command.succeeded"
    COMMAND_FAILED = "command.failed"
    COMMAND_EXPIRED = "command.expired"
