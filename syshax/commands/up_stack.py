"""Control-plane side of ``syshax up``: the local node, its tokens, the default hetero
deployment of simulated engines, and waiting for them. Uses the ORM and the same services the
API and admin use; nothing here bypasses the workflow."""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import json
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from common.files import write_text_atomic

if TYPE_CHECKING:
    from controlplane.deployments.models import DeploymentProfile

LOCAL_PROFILE = "local-hetero-sim"
LOCAL_VLLM_PROFILE = "local-hetero-vllm"
LOCAL_DEPLOYMENT = "local-hetero"
SIM_MODEL = "deepseek-r1-distill-qwen-32b"


def local_node_name() -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-")[:55]
    return name or "local"


def ensure_admin() -> str | None:
    """Create the admin user on the first run; return its password only then."""
    from django.contrib.auth import get_user_model

    users = get_user_model()
    if users.objects.filter(username="admin").exists():
        return None
    password = secrets.token_urlsafe(12)
    users.objects.create_superuser("admin", "admin@localhost", password)
    return password


# The router's API key: what clients send as ``Authorization: Bearer``. Its prefix makes it
# easy to spot (and to check that no command line carries it).
ROUTER_API_KEY_PREFIX = "sxk_"


def _token_store(var_dir: Path) -> Path:
    path = var_dir / "up" / "tokens.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _read_tokens(var_dir: Path) -> dict[str, str]:
    store = _token_store(var_dir)
    return dict(json.loads(store.read_text())) if store.exists() else {}


def _write_tokens(var_dir: Path, tokens: dict[str, str]) -> None:
    # Mode 0600 from its first byte; replaced whole, so a reader never sees half of it.
    write_text_atomic(_token_store(var_dir), json.dumps(tokens), mode=0o600)


def admin_api_token(var_dir: Path) -> str:
    """The admin's API token, for the benchmark CLI to read the control plane. Kept in
    var/up/tokens.json (only its hash is in the database); a missing, revoked or expired one
    is issued again."""
    from django.contrib.auth import get_user_model

    from controlplane.access.models import PersonalToken, hash_token

    tokens = _read_tokens(var_dir)
    admin = get_user_model().objects.get(username="admin")
    key = tokens.get("admin_api", "")
    stored = PersonalToken.objects.filter(key_hash=hash_token(key), user=admin).first()
    if stored is None or not stored.active:
        tokens["admin_api"] = PersonalToken.issue(admin, "syshax up", acting_user="syshax up")[1]
        _write_tokens(var_dir, tokens)
    return tokens["admin_api"]


def ensure_router_api_key(var_dir: Path) -> tuple[str, bool]:
    """The local router's API key, made on the first run and kept in var/up/tokens.json:
    (key, whether it is new)."""
    return _ensure_router_key(var_dir, "router_api_key")


def ensure_router_benchmark_key(var_dir: Path) -> str:
    """The local router's benchmark key, which may force a policy mode per request (the
    benchmark's modes, the PD smoke test), kept beside the API key; no client gets it."""
    return _ensure_router_key(var_dir, "router_benchmark_key")[0]


def _ensure_router_key(var_dir: Path, name: str) -> tuple[str, bool]:
    tokens = _read_tokens(var_dir)
    if tokens.get(name, "").startswith(ROUTER_API_KEY_PREFIX):
        return tokens[name], False
    tokens[name] = ROUTER_API_KEY_PREFIX + secrets.token_urlsafe(32)
    _write_tokens(var_dir, tokens)
    return tokens[name], True


def ensure_tokens(var_dir: Path, node_name: str) -> dict[str, str]:
    """Agent and router tokens for the local stack, kept in var/up/tokens.json (mode 0600).
    Only their hashes are in the database; a missing or revoked one is issued again."""
    from controlplane.access.models import MachineCredential, hash_token
    from controlplane.inventory.models import Node

    tokens = _read_tokens(var_dir)
    node, _ = Node.objects.get_or_create(name=node_name, defaults={"address": "127.0.0.1"})
    wanted = {
        "agent": ("agent", f"agent-{node_name}", node),
        "router": ("router", "local-router", None),
    }
    for key, (kind, name, bound) in wanted.items():
        token = tokens.get(key, "")
        valid = (
            MachineCredential.objects.filter(
                key_hash=hash_token(token), revoked_at__isnull=True, node=bound
            ).exists()
            if token
            else False
        )
        if not valid:
            tokens[key] = MachineCredential.issue(kind, name, node=bound, created_by="syshax up")[1]
    _write_tokens(var_dir, tokens)
    return tokens


def ensure_deployment(node_name: str, gpu_port: int, cpu_port: int) -> int:
    """The default hetero profile (simulated A100 + simulated Kunpeng CPU engine, 32B q4_0)
    placed on the local node."""
    from controlplane.deployments.models import DeploymentProfile

    profile, _ = DeploymentProfile.objects.update_or_create(
        name=LOCAL_PROFILE,
        defaults={
            "description": "syshax up: simulated A100 80GB prefill/decode + simulated Kunpeng "
            "920 CPU decode engine",
            "model": SIM_MODEL,
            "served_model_name": SIM_MODEL,
            "quantization": "q4_0",
            "engine": "simulator",
            # Upstream vLLM's PD wire (kv_transfer_params), as a real vLLM 0.32 pair would run.
            "pd_protocol": "vllm",
            "sim_gpu_device": "a100-80gb",
            "sim_cpu_device": "kunpeng-920-7280z",
            "gpu_port": gpu_port,
            "cpu_port": cpu_port,
            "max_model_len": 8192,
            "health_timeout_seconds": 120.0,
        },
    )
    return _place_default(profile, node_name)


def _place_default(profile: DeploymentProfile, node_name: str) -> int:
    """The local deployment on ``node_name``, running ``profile`` (switched if it ran
    another one, e.g. the simulated pair before ``--engine vllm``)."""
    from controlplane.deployments.models import Deployment
    from controlplane.inventory.models import Node
    from controlplane.policy.services import ensure_default_policy

    node = Node.objects.get(name=node_name)
    deployment, created = Deployment.objects.get_or_create(
        name=LOCAL_DEPLOYMENT,
        defaults={"profile": profile, "node": node, "policy": ensure_default_policy()},
    )
    if not created and deployment.profile_id != profile.pk:
        deployment.profile = profile
        deployment.save(update_fields=["profile", "updated_at"])
    return int(deployment.pk)


def ensure_vllm_deployment(
    node_name: str,
    gpu_port: int,
    cpu_port: int,
    *,
    model: str,
    served: str,
    python: str,
    max_model_len: int | None = None,
) -> int:
    """The hetero profile on two real vLLM engines of ``model`` run by ``python``, with the
    KV connector (docs/kv-connector.md), placed on the local node as the default deployment."""
    from controlplane.deployments.models import DeploymentProfile

    command = [python, "-m", "vllm.entrypoints.openai.api_server"]
    # A local model directory needs no hub (there may be none); a hub id keeps the default.
    offline = {"HF_HUB_OFFLINE": "1"} if Path(model).is_dir() else {}
    profile, _ = DeploymentProfile.objects.update_or_create(
        name=LOCAL_VLLM_PROFILE,
        defaults={
            "description": "syshax up --engine vllm: a GPU-role and a CPU engine of real vLLM",
            "model": str(Path(model).resolve()) if offline else model,
            "served_model_name": served,
            "quantization": "none",
            "engine": "vllm",
            "pd_protocol": "vllm",
            "gpu_command": command,
            "cpu_command": command,
            # Without an NVIDIA card the GPU-role engine is vLLM's CPU backend too: it needs
            # a KV space of its own.
            "gpu_env": {**offline, "VLLM_CPU_KVCACHE_SPACE": "2"},
            "cpu_env": offline,
            "cpu_kv_cache_space_gb": 2,
            "gpu_port": gpu_port,
            "cpu_port": cpu_port,
            # None: the model's own length, as vLLM derives it from its config.json.
            "max_model_len": max_model_len,
            "max_num_seqs": 64,
            # Pinned host memory on this machine: what a small model's transfers need.
            "kv_arena_mib": 256,
            "health_timeout_seconds": 600.0,
        },
    )
    return _place_default(profile, node_name)


def node_ready(node_name: str) -> bool:
    from controlplane.inventory.models import Node

    return Node.objects.filter(name=node_name, status="online").exclude(inventory_hash="").exists()


class Timeline:
    """Prints a deployment's new timeline events as they appear."""

    def __init__(self, deployment_id: int, printer: Callable[[str], None]) -> None:
        self.deployment_id = deployment_id
        self.printer = printer
        self.last = 0

    def poll(self) -> str:
        from controlplane.deployments.models import Deployment, DeploymentEvent

        for event in DeploymentEvent.objects.filter(
            deployment_id=self.deployment_id, pk__gt=self.last
        ).order_by("pk"):
            self.last = event.pk
            self.printer(f"  [{event.level}] {event.step}: {event.message}")
        return str(Deployment.objects.get(pk=self.deployment_id).state)


def deploy(deployment_id: int) -> None:
    from controlplane.deployments.models import Deployment
    from controlplane.deployments.services import request_deploy

    request_deploy(Deployment.objects.get(pk=deployment_id), acting_user="syshax up")


def stop(deployment_id: int) -> None:
    from controlplane.deployments.models import Deployment
    from controlplane.deployments.services import request_stop

    request_stop(Deployment.objects.get(pk=deployment_id), acting_user="syshax up")


def deployment_state(deployment_id: int) -> tuple[str, str]:
    from controlplane.deployments.models import Deployment

    deployment = Deployment.objects.get(pk=deployment_id)
    return str(deployment.state), deployment.state_reason
