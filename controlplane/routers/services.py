from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Max, OuterRef, Subquery
from django.utils import timezone

from common.errors import FieldError
from common.hosts import is_http_url
from common.kv_events import engine_kv_events_url
from common.routing import DeploymentSpec, schedules_by_priority
from controlplane.access.models import MachineCredential
from controlplane.deployments.choices import DeploymentState
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.inventory.models import Heartbeat
from controlplane.routers.models import RouterInstance, RouterStatsSample


class RouterNameTaken(FieldError):
    def __init__(self, name: str) -> None:
        super().__init__("name", f"router {name!r} is registered with another credential")


def register_router(
    credential: MachineCredential, *, name: str, version: str, listen_url: str
) -> RouterInstance:
    """Idempotent by name: a restarted router gets its own row back."""
    with transaction.atomic(durable=True):
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


def record_stats(
    router: RouterInstance, stats: dict[str, Any], *, now: datetime | None = None
) -> None:
    now = now or timezone.now()
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
            serving=stats.get("serving", {}),
        )


def record_stats_batch(
    reports: Sequence[tuple[int, int, dict[str, Any]]],
) -> set[tuple[int, int]]:
    """Many routers' stats at once, for the machine gateway's group commit
    (docs/decisions/0036-group-commits-one-statement.md),
    each stored as :func:`record_stats` stores it. A report is ``(router id, the id of the
    credential that sent it, validated stats)`` (``StatsSerializer``'s ``validated_data``
    form); it is stored only when that router is the credential's own and the credential is
    not revoked. The answer is the ``(router id, credential id)`` of the reports stored: a
    report of another credential's router is left alone (its router's own report in the same
    batch is not its answer), and must go to the view, which refuses it. A router reported
    twice keeps its last report and gets a sample for each.

    On PostgreSQL the batch is one statement, atomic by itself; elsewhere each report is
    :func:`record_stats` in one transaction."""
    if not reports:
        return set()
    if connection.vendor != "postgresql":
        now = timezone.now()
        owners = dict(
            RouterInstance.objects.filter(
                pk__in={r for r, _, _ in reports}, credential__revoked_at__isnull=True
            ).values_list("pk", "credential_id")
        )
        stored = set()
        with transaction.atomic(durable=True):
            for router_id, credential_id, stats in reports:
                if owners.get(router_id) == credential_id:
                    record_stats(RouterInstance(pk=router_id), stats, now=now)
                    stored.add((router_id, credential_id))
        return stored
    sql, params = stats_batch_statement(reports)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return stats_batch_stored(cursor.fetchall())


def stats_batch_statement(
    reports: Sequence[tuple[int, int, dict[str, Any]]],
) -> tuple[str, dict[str, Any]]:
    """The PostgreSQL statement that stores a batch as :func:`record_stats_batch` does, and
    its parameters; :func:`stats_batch_stored` reads what it returns. The machine gateway
    sends it on a connection of its own (docs/decisions/0038-gateway-writes-from-event-loop.md)."""
    now = timezone.now()
    doc = json.dumps(
        [{"router": r, "credential": c, "stats": stats} for r, c, stats in reports],
        allow_nan=False,  # not JSON; the serializer refuses it before it gets here
        separators=(",", ":"),
    )
    return _stats_statement(), {"doc": doc, "now": now, "iso": now.isoformat()}


def stats_batch_stored(rows: Iterable[Sequence[Any]]) -> set[tuple[int, int]]:
    """The ``(router id, credential id)`` of the reports stored, from the statement's rows."""
    return {(int(row[0]), int(row[1])) for row in rows}


@functools.cache
def _stats_statement() -> str:
    """One PostgreSQL statement over one JSON document of the reports (in their order):
    ``seen`` updates each router from its last report by its own (active) credential, and
    ``samples`` stores a sample of every report by that router and that credential."""
    q = connection.ops.quote_name
    router, sample = q(RouterInstance._meta.db_table), q(RouterStatsSample._meta.db_table)
    credential = q(MachineCredential._meta.db_table)

    def col(model: Any, name: str) -> str:
        return str(q(model._meta.get_field(name).column))

    version = "CAST(x.stats->>'policy_version' AS INTEGER)"  # a JSON null is NULL
    rate = "CAST(x.stats->>'request_rate' AS DOUBLE PRECISION)"
    return (
        "WITH s AS MATERIALIZED ("
        " SELECT * FROM ROWS FROM (jsonb_to_recordset(CAST(%(doc)s AS jsonb))"
        "  AS (router BIGINT, credential BIGINT, stats JSONB)) WITH ORDINALITY"
        "  AS s(router, credential, stats, n)),"
        f" seen AS (UPDATE {router} SET {col(RouterInstance, 'last_seen_at')} = %(now)s,"
        f"  {col(RouterInstance, 'policy_version')} = {version},"
        f"  {col(RouterInstance, 'request_rate')} = {rate},"
        f"  {col(RouterInstance, 'stats')} ="
        "   x.stats || jsonb_build_object('received_at', CAST(%(iso)s AS TEXT))"
        "  FROM (SELECT DISTINCT ON (s.router) s.* FROM s"
        f"   JOIN {router} o ON o.{col(RouterInstance, 'id')} = s.router"
        f"   AND o.{col(RouterInstance, 'credential')} = s.credential"
        f"   JOIN {credential} c ON c.{col(MachineCredential, 'id')} = s.credential"
        f"   AND c.{col(MachineCredential, 'revoked_at')} IS NULL"
        "   ORDER BY s.router, s.n DESC) x"
        f"  WHERE {router}.{col(RouterInstance, 'id')} = x.router"
        f"  AND {router}.{col(RouterInstance, 'credential')} = x.credential"
        f"  RETURNING {router}.{col(RouterInstance, 'id')} AS router,"
        f"  {router}.{col(RouterInstance, 'credential')} AS credential),"
        f" samples AS (INSERT INTO {sample} ({col(RouterStatsSample, 'router')},"
        f"  {col(RouterStatsSample, 'received_at')}, {col(RouterStatsSample, 'request_rate')},"
        f"  {col(RouterStatsSample, 'decisions')}, {col(RouterStatsSample, 'policy_version')},"
        f"  {col(RouterStatsSample, 'serving')})"
        f"  SELECT x.router, %(now)s, {rate}, x.stats->'decisions', {version},"
        "  COALESCE(x.stats->'serving', CAST('{}' AS jsonb))"
        "  FROM s x JOIN seen USING (router, credential) ORDER BY x.n)"
        " SELECT router, credential FROM seen"
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
            priority_scheduling=_priority_scheduling(d.profile),
            gpu_kv_events_url=engine_kv_events_url(d.profile.gpu_extra_args, d.gpu_endpoint),
            cpu_kv_events_url=engine_kv_events_url(d.profile.cpu_extra_args, d.cpu_endpoint)
            if d.profile.enable_cpu_engine
            else None,
            **_telemetry(d),
        ).as_api()
        for d in rows
        # An endpoint built from an address stored before addresses were checked is never
        # handed to a router (common/hosts.py).
        if all(not url or is_http_url(url) for url in (d.gpu_endpoint, d.cpu_endpoint))
    ]


def _priority_scheduling(profile: DeploymentProfile) -> bool:
    """Whether every engine of the profile schedules by priority (its extra arguments say
    ``--scheduling-policy priority``): only then may the router send a request's class
    priority, which an engine scheduling first come, first served refuses."""
    engines = [profile.gpu_extra_args]
    if profile.enable_cpu_engine:
        engines.append(profile.cpu_extra_args)
    return all(schedules_by_priority(list(args)) for args in engines)


def deployments_etag(payload: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
    return f'"deployments-{digest}"'


# Rows deleted per statement by the prune (a router reports every 10 s: 8,640 rows a day).
PRUNE_BATCH = 10_000


def prune_samples(retention_hours: int, batch: int = PRUNE_BATCH) -> int:
    """Delete stats samples older than the retention, ``batch`` rows per transaction."""
    cutoff = timezone.now() - timedelta(hours=retention_hours)
    expired = RouterStatsSample.objects.filter(received_at__lt=cutoff).order_by()
    total = 0
    while True:
        ids = list(expired.values_list("pk", flat=True)[:batch])
        if not ids:
            return total
        deleted, _ = RouterStatsSample.objects.filter(pk__in=ids).delete()
        total += deleted
