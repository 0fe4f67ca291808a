from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import transaction
from django.db.models import Max, OuterRef, Subquery
from django.utils import timezone

from controlplane.access.models import MachineCredential
from controlplane.deployments.choices import DeploymentState
from controlplane.deployments.models import Deployment
from controlplane.inventory.models import Heartbeat
from controlplane.routers.models import RouterInstance, RouterStatsSample
from syshax.common.errors import FieldError
from syshax.common.routing import DeploymentSpec


class RouterNameTaken(FieldError):
    def __init__(self, name: str) -> None:
        super().__init__("name", f"router {name!r} is registered with another credential")


def register_router(
    credential: MachineCredential, *, name: str, version: str, listen_url: str
) -> RouterInstance:
    """Idempotent by name: a restarted router gets its own row back."""
    with transaction.atomic():
        router, created = RouterInstance.objects.select_for_update().get_or_create(
            name=name,
            defaults={"credential": credential, "version": version, "listen_url": listen_url},
        )
        if not created and router.credential_id != credential.pk:
            raise RouterNameTaken(name)
        router.version = version
        router.listen_url = listen_url
        router.last_seen_at = timezone.now()
        router.save()
    return router


def record_stats(router: RouterInstance, stats: dict[str, Any]) -> None:
    now = timezone.now()
    router.last_seen_at = now
    router.policy_version = stats.get("policy_version")
    router.request_rate = stats.get("request_rate", 0.0)
    router.stats = {**stats, "received_at": now.isoformat()}
    with transaction.atomic():
        router.save(update_fields=["last_seen_at", "policy_version", "request_rate", "stats"])
        RouterStatsSample.objects.create(
            router=router,
            received_at=now,
            request_rate=router.request_rate,
            decisions=stats.get("decisions", {}),
            policy_version=router.policy_version,
        )


# Telemetry goes to routers in steps of this many degrees or percent, so a reading that
# wanders by a degree does not change the payload (and its ETag) on every heartbeat.
TELEMETRY_STEP = 5.0


def _step(value: float | None) -> float | None:
    return None if value is None else TELEMETRY_STEP * (value // TELEMETRY_STEP)


def _telemetry(d: Deployment) -> dict[str, float | None]:
    """The node readings the deciders treat as limits (docs/router.md): the hottest card the
    deployment holds, and host RAM use from the node's latest heartbeat, both stepped."""
    used, total = d.host_memory_used, d.host_memory_total  # type: ignore[attr-defined]
    host = 100.0 * used / total if used is not None and total else None
    return {
        "gpu_temperature_c": _step(d.gpu_temperature),  # type: ignore[attr-defined]
        "host_memory_percent": _step(host),
    }


def routable_deployments() -> list[dict[str, Any]]:
    latest = Heartbeat.objects.filter(node=OuterRef("node")).order_by("-received_at")
    rows = (
        Deployment.objects.filter(state=DeploymentState.RUNNING)
        .select_related("profile", "policy")
        .annotate(
            gpu_temperature=Max("accelerator_claims__accelerator__temperature_c"),
            host_memory_used=Subquery(latest.values("memory_used_bytes")[:1]),
            host_memory_total=Subquery(latest.values("memory_total_bytes")[:1]),
        )
        .order_by("pk")
    )
    return [
        DeploymentSpec(
            id=d.pk,
            name=d.name,
            model=d.profile.model_name_for_clients,
            policy=d.policy.name if d.policy else "default",
            pd_protocol=d.profile.pd_protocol,
            generation=d.generation,
            state=d.state,
            gpu_url=d.gpu_endpoint,
            cpu_url=d.cpu_endpoint or None,
            # The CPU engine's own --max-num-seqs: the router admits no more CPU decodes.
            cpu_max_num_seqs=d.profile.cpu_max_num_seqs if d.profile.enable_cpu_engine else None,
            **_telemetry(d),
        ).as_api()
        for d in rows
    ]


def deployments_etag(payload: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
    return f'"deployments-{digest}"'
