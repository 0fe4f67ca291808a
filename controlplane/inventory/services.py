"""Operations on the inventory that touch several rows. Each is atomic and audited."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from common.inventory import inventory_hash
from controlplane.core import audit
from controlplane.core.actors import Actor
from controlplane.core.models import Clock
from controlplane.core.services import checked_delete
from controlplane.inventory import signals
from controlplane.inventory.choices import NODE_LIFECYCLE, InventoryAuditAction, NodeStatus
from controlplane.inventory.models import Accelerator, CpuTopology, Heartbeat, Node, NumaNode


def _holders(cards: QuerySet[Accelerator]) -> list[str]:
    """The deployments that claim any of ``cards``, by name."""
    held = cards.filter(claim__isnull=False).values_list("claim__deployment__name", flat=True)
    return sorted(set(held))


def node_delete_refusal(node: Node) -> str:
    """Why the node may not be deleted now, or "": its cards go with it, and with them the
    claims of deployments whose engines may run there. (Deployments placed on it protect it
    too, through their key: Django's ProtectedError names them.)"""
    held = _holders(Accelerator.objects.filter(node=node))
    if held:
        return (
            f"cannot delete node {node.name!r} while deployments hold its cards: "
            f"{', '.join(held)} (stop them first)"
        )
    return ""


def delete_node(node: Node, *, acting_user: Actor) -> None:
    """Delete the node and what it reported, with an audit row; raises DeleteRefused while a
    deployment holds one of its cards, ProtectedError while deployments are placed on it."""
    checked_delete(
        node, node_delete_refusal, InventoryAuditAction.NODE_DELETED, acting_user=acting_user
    )


def accelerator_delete_refusal(accelerator: Accelerator) -> str:
    """Why the card may not be deleted now, or "": a deployment claims it."""
    held = _holders(Accelerator.objects.filter(pk=accelerator.pk))
    if held:
        return (
            f"cannot delete accelerator {accelerator} while deployment {held[0]!r} holds it "
            "(stop it first)"
        )
    return ""


def delete_accelerator(accelerator: Accelerator, *, acting_user: Actor) -> None:
    """Delete a card, with an audit row; raises DeleteRefused while a deployment claims it."""
    checked_delete(
        accelerator,
        accelerator_delete_refusal,
        InventoryAuditAction.ACCELERATOR_DELETED,
        acting_user=acting_user,
        detail=lambda card: {"uuid": card.uuid},
    )


def apply_inventory(node: Node, payload: dict[str, Any], *, acting_user: Actor) -> bool:
    """Rewrite the node's topology and accelerators if they changed. Returns whether they did."""
    digest = inventory_hash(payload)
    with transaction.atomic(durable=True):
        node = Node.objects.select_for_update().get(pk=node.pk)
        if node.inventory_hash == digest:
            return False
        cpu = payload["cpu"]
        topology = {
            "model_name": cpu.get("model", ""),
            "architecture": cpu.get("architecture", ""),
            "sockets": cpu["sockets"],
            "physical_cores": cpu["physical_cores"],
            "threads": cpu["threads"],
            "isa_flags": sorted(set(cpu.get("isa_flags", []))),
            "memory_total_bytes": cpu.get("memory_total_bytes", 0),
        }
        # One upsert each for the topology and for all the cards, not a read and a write
        # per row (decision 28): 5,000 agents registering at once are 5,000 of these.
        CpuTopology.objects.bulk_create(
            [CpuTopology(node=node, **topology)],
            update_conflicts=True,
            unique_fields=["node"],
            update_fields=list(topology),
        )
        NumaNode.objects.filter(node=node).delete()
        NumaNode.objects.bulk_create(
            NumaNode(
                node=node,
                index=item["index"],
                cpus=item["cpus"],
                memory_total_bytes=item.get("memory_total_bytes", 0),
            )
            for item in payload.get("numa_nodes", [])
        )
        _sync_accelerators(node, payload.get("accelerators", []))
        node.inventory_hash = digest
        node.inventory_updated_at = timezone.now()
        for field in ("agent_version", "hostname", "address"):
            if payload.get(field):
                setattr(node, field, payload[field])
        node.save()
        audit.record(
            InventoryAuditAction.INVENTORY_UPDATED,
            node,
            acting_user=acting_user,
            detail={"hash": digest},
        )
    return True


def _sync_accelerators(node: Node, reported: list[dict[str, Any]]) -> None:
    # Remove vanished cards first: a replacement card may take a removed card's index.
    Accelerator.objects.filter(node=node).exclude(uuid__in=[a["uuid"] for a in reported]).delete()
    if not reported:
        return
    Accelerator.objects.bulk_create(
        [
            Accelerator(
                node=node,
                uuid=item["uuid"],
                kind=item["kind"],
                vendor=item.get("vendor", ""),
                model_name=item.get("model", ""),
                index=item["index"],
                memory_total_bytes=item.get("memory_total_bytes", 0),
                simulated=bool(item.get("simulated", False)),
            )
            for item in reported
        ],
        update_conflicts=True,
        unique_fields=["node", "uuid"],
        update_fields=[
            "kind",
            "vendor",
            "model_name",
            "index",
            "memory_total_bytes",
            "simulated",
            "updated_at",
        ],
    )


def record_heartbeat(node: Node, payload: dict[str, Any]) -> Node:
    """Store one heartbeat row, refresh live accelerator readings and bring the node online.

    The fleet's hottest write: a steady heartbeat is one transaction of three statements (the
    row, one UPDATE for every card's readings, the node's ``last_heartbeat_at``). ``node``
    needs only ``status`` and ``inventory_hash`` loaded; both are current in the answer.
    """
    now = timezone.now()
    readings = payload.get("accelerators", [])
    with transaction.atomic(durable=True):
        Heartbeat.objects.create(
            node=node,
            received_at=now,
            cpu_percent=payload.get("cpu_percent", 0.0),
            memory_used_bytes=payload.get("memory_used_bytes", 0),
            memory_total_bytes=payload.get("memory_total_bytes", 0),
            accelerators=readings,
        )
        store_readings([(node.pk, readings)])
        came_back = _mark_seen(node, now)
        if came_back:
            audit.record(InventoryAuditAction.NODE_ONLINE, node, acting_user="agent")
            node_id = node.pk
            transaction.on_commit(lambda: signals.node_returned.send(Node, node_id=node_id))
    return node


def record_steady_heartbeats(
    reports: Sequence[tuple[int, dict[str, Any]]],
) -> dict[int, tuple[str, str]]:
    """Many nodes' heartbeats at once, for the machine gateway's group commit (decision 36):
    each node's ``last_heartbeat_at``, its heartbeat row and its cards' readings, as
    :func:`record_heartbeat` stores them.

    Only nodes whose status a heartbeat leaves as it is (online, draining) are recorded; the
    answer maps each of them to its ``(status, inventory_hash)``. A node not in the answer
    (returning from offline, pending, or unknown) was left untouched, and its heartbeat must
    go through :func:`record_heartbeat`, which brings it back and announces it. ``reports``
    are validated payloads (``HeartbeatInSerializer``'s ``validated_data`` form).

    On PostgreSQL the batch is one statement (:func:`steady_heartbeats_statement`), atomic by
    itself; elsewhere three in one transaction.
    """
    if not reports:
        return {}
    if connection.vendor == "postgresql":
        return _record_steady_statement(reports)
    return _record_steady_transaction(
        connection.ops.adapt_datetimefield_value(timezone.now()), reports
    )


def _record_steady_transaction(
    now: Any, reports: Sequence[tuple[int, dict[str, Any]]]
) -> dict[int, tuple[str, str]]:
    """The batch as three statements in a transaction: the nodes' ``UPDATE``, the heartbeat
    rows' ``INSERT`` and the cards' ``UPDATE``. (It was PostgreSQL's too, before the one
    statement: ``scripts/bench/heartbeat_write_timing.py`` times the two there.)"""
    quote = connection.ops.quote_name
    node_ids = sorted({node_id for node_id, _ in reports})
    steady = sorted(_STEADY)
    source, params = _rows(["BIGINT"], [(node_id,) for node_id in node_ids])
    pk, status = quote(str(Node._meta.pk.column)), quote("status")  # type: ignore[union-attr]
    mark = (
        f"UPDATE {quote(Node._meta.db_table)} SET {quote('last_heartbeat_at')} = %s FROM {source}"
        f" WHERE {pk} = r.column1 AND {status} IN ({', '.join(['%s'] * len(steady))})"
        f" RETURNING {pk}, {status}, {quote('inventory_hash')}"
    )
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(mark, [now, *params, *steady])
        seen = {int(row[0]): (str(row[1]), str(row[2])) for row in cursor.fetchall()}
        recorded = [(node_id, payload) for node_id, payload in reports if node_id in seen]
        if recorded:
            _insert_heartbeats(cursor, now, recorded)
            store_readings((node_id, p.get("accelerators", [])) for node_id, p in recorded)
    return seen


def _column(model: Any, field: str) -> str:
    return str(connection.ops.quote_name(model._meta.get_field(field).column))


@functools.cache
def _steady_statement() -> str:
    """The batch as one PostgreSQL statement over one JSON document of the heartbeats (in
    their order): ``seen`` marks the steady nodes among them, and only the heartbeats of
    those are stored (``beats``) and their cards' readings written (``cards``), a card
    reported twice keeping its last readings. Data-modifying ``WITH`` parts run in one
    snapshot and commit or fail together, so the statement needs no transaction of its
    own: one round trip to the database where a transaction of three took five, and its
    text is the same for any batch. It finds every row it writes by its key, whatever the
    planner's statistics say of the node statuses."""
    q = connection.ops.quote_name
    node, beat, card = (q(m._meta.db_table) for m in (Node, Heartbeat, Accelerator))
    pk, status = _column(Node, "id"), _column(Node, "status")
    steady = ", ".join(f"'{s}'" for s in sorted(_STEADY))  # the choices' own values
    stored = ", ".join(
        _column(Heartbeat, f)
        for f in (
            "received_at",
            "node",
            "cpu_percent",
            "memory_used_bytes",
            "memory_total_bytes",
            "accelerators",
        )
    )
    readings = ", ".join(f"{_column(Accelerator, name)} = c.{name}" for name in _READINGS)
    picked = ", ".join(  # a reading left out takes its default, as in store_readings
        f"c.{name}" if default is None else f"COALESCE(c.{name}, {default!r}) AS {name}"
        for name, default in _READINGS.items()
    )
    return (
        "WITH b AS MATERIALIZED ("
        " SELECT * FROM ROWS FROM (jsonb_to_recordset(CAST(%(beats)s AS jsonb))"
        "  AS (node BIGINT, cpu DOUBLE PRECISION, used BIGINT, total BIGINT, cards JSONB))"
        "  WITH ORDINALITY AS b(node, cpu, used, total, cards, n)),"
        f" seen AS (UPDATE {node} SET {_column(Node, 'last_heartbeat_at')} = %(now)s"
        f"  WHERE {pk} = ANY (ARRAY(SELECT DISTINCT node FROM b))"
        # The status is checked on the nodes found by id: as a bare column the planner may
        # read it through its index, every online node of the fleet for each batch (2 ms of
        # a 3-heartbeat batch's 2.7 at 5,000 nodes, decision 36).
        f"  AND ({status} || '') IN ({steady})"
        f"  RETURNING {pk} AS node, {status} AS status,"
        f"  {_column(Node, 'inventory_hash')} AS inventory_hash),"
        f" beats AS (INSERT INTO {beat} ({stored})"
        "  SELECT %(now)s, b.node, b.cpu, b.used, b.total, b.cards FROM b JOIN seen USING (node)"
        "  ORDER BY b.n),"
        f" cards AS (UPDATE {card} SET {readings} FROM ("
        f"  SELECT DISTINCT ON (b.node, c.uuid) b.node, c.uuid, {picked}"
        "  FROM b JOIN seen USING (node), ROWS FROM (jsonb_to_recordset(b.cards)"
        "   AS (uuid TEXT, utilization_percent DOUBLE PRECISION, memory_used_bytes BIGINT,"
        "   temperature_c DOUBLE PRECISION)) WITH ORDINALITY AS c"
        "  ORDER BY b.node, c.uuid, b.n DESC, c.ordinality DESC) c"
        f"  WHERE {card}.{_column(Accelerator, 'node')} = c.node"
        f"  AND {card}.{_column(Accelerator, 'uuid')} = c.uuid)"
        " SELECT node, status, inventory_hash FROM seen"
    )


def steady_heartbeats_statement(
    reports: Sequence[tuple[int, dict[str, Any]]],
) -> tuple[str, dict[str, Any]]:
    """The PostgreSQL statement that records a batch as :func:`record_steady_heartbeats`
    does, and its parameters; :func:`steady_heartbeats_seen` reads what it returns. The
    machine gateway sends it on a connection of its own (decision 38)."""
    beats = json.dumps(
        [
            {
                "node": node_id,
                "cpu": payload.get("cpu_percent", 0.0),
                "used": payload.get("memory_used_bytes", 0),
                "total": payload.get("memory_total_bytes", 0),
                "cards": payload.get("accelerators", []),
            }
            for node_id, payload in reports
        ],
        allow_nan=False,  # not JSON; a reading is finite before it gets here
        separators=(",", ":"),
    )
    return _steady_statement(), {"beats": beats, "now": timezone.now()}


def steady_heartbeats_seen(rows: Iterable[Sequence[Any]]) -> dict[int, tuple[str, str]]:
    """Each recorded node's ``(status, inventory_hash)``, from the statement's rows."""
    return {int(row[0]): (str(row[1]), str(row[2])) for row in rows}


def _record_steady_statement(
    reports: Sequence[tuple[int, dict[str, Any]]],
) -> dict[int, tuple[str, str]]:
    sql, params = steady_heartbeats_statement(reports)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return steady_heartbeats_seen(cursor.fetchall())


def _insert_heartbeats(cursor: Any, now: Any, recorded: list[tuple[int, dict[str, Any]]]) -> None:
    quote = connection.ops.quote_name
    fields = ["received_at", "node", "cpu_percent", "memory_used_bytes", "memory_total_bytes"]
    columns = [
        quote(str(Heartbeat._meta.get_field(f).column))  # type: ignore[union-attr]
        for f in [*fields, "accelerators"]
    ]
    source, params = _rows(
        ["BIGINT", "DOUBLE PRECISION", "BIGINT", "BIGINT", "JSONB"],
        [
            (
                node_id,
                payload.get("cpu_percent", 0.0),
                payload.get("memory_used_bytes", 0),
                payload.get("memory_total_bytes", 0),
                payload.get("accelerators", []),
            )
            for node_id, payload in recorded
        ],
    )
    cursor.execute(
        f"INSERT INTO {quote(Heartbeat._meta.db_table)} ({', '.join(columns)})"
        f" SELECT %s, r.column1, r.column2, r.column3, r.column4, r.column5 FROM {source}",
        [now, *params],
    )


def _rows(types: Sequence[str], rows: Sequence[Sequence[Any]]) -> tuple[str, list[Any]]:
    """A table of ``rows`` (at least one) to join or select from, as ``r`` with columns
    ``column1``, ``column2``…, and its parameters. A ``JSONB`` column takes any JSON value.

    On PostgreSQL it is one JSON document (``jsonb_to_recordset``): the statement's text is
    the same for any number of rows, and the whole table is one string the driver quotes at
    C speed. An array parameter a column cost five times the CPU for the heartbeat rows
    (psycopg quotes each element of a list in Python: 14.4 against 2.7 ms for 100 heartbeats,
    ``scripts/bench/heartbeat_batch_timing.py``, decision 31), and that CPU is the machine
    gateway's, under its one lock. Elsewhere it is a ``VALUES`` list, with a ``JSONB``
    column's values as JSON text."""
    if connection.vendor == "postgresql":
        names = [f"column{i}" for i in range(1, len(types) + 1)]
        columns = ", ".join(f"{name} {t}" for name, t in zip(names, types, strict=True))
        table = json.dumps(
            [dict(zip(names, row, strict=True)) for row in rows],
            allow_nan=False,  # not JSON; a reading is finite before it gets here
            separators=(",", ":"),
        )
        return f"jsonb_to_recordset(CAST(%s AS jsonb)) AS r({columns})", [table]
    sent = ["TEXT" if t == "JSONB" else t for t in types]
    row = "(" + ", ".join(f"CAST(%s AS {t})" for t in sent) + ")"
    values = [
        json.dumps(v) if t == "JSONB" else v for r in rows for v, t in zip(r, types, strict=True)
    ]
    return f"(VALUES {', '.join([row] * len(rows))}) AS r", values


def store_readings(reports: Iterable[tuple[int, list[dict[str, Any]]]]) -> None:
    """Every card's live readings, of any number of nodes, in one UPDATE joined to a table of
    them (:func:`_rows`). A card reported twice keeps its last readings.

    The ORM's form of this (a CASE per column and card, or ``bulk_update``) costs several
    milliseconds of CPU to compile on every heartbeat; this statement costs none, and runs on
    PostgreSQL and SQLite (3.33+) alike.
    """
    cards: dict[tuple[int, str], dict[str, Any]] = {}
    for node_id, readings in reports:
        for reading in readings:
            cards[(node_id, reading["uuid"])] = reading
    if not cards:
        return
    quote = connection.ops.quote_name
    column = {
        name: quote(str(Accelerator._meta.get_field(name).column))  # type: ignore[union-attr]
        for name in ("node", "uuid", *_READINGS)
    }
    source, params = _rows(
        ["BIGINT", "TEXT", "DOUBLE PRECISION", "BIGINT", "DOUBLE PRECISION"],
        [
            (node_id, uuid, *(reading.get(name, default) for name, default in _READINGS.items()))
            for (node_id, uuid), reading in cards.items()
        ],
    )
    sql = (
        f"UPDATE {quote(Accelerator._meta.db_table)} SET "
        + ", ".join(f"{column[name]} = r.column{i}" for i, name in enumerate(_READINGS, 3))
        + f" FROM {source}"
        f" WHERE {column['node']} = r.column1 AND {column['uuid']} = r.column2"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


# The live readings a heartbeat carries per card, with their defaults, in the VALUES order.
_READINGS: dict[str, Any] = {
    "utilization_percent": 0.0,
    "memory_used_bytes": 0,
    "temperature_c": None,
}


def _mark_seen(node: Node, now: datetime) -> bool:
    """Set ``last_heartbeat_at``; a pending or offline node comes online. Returns whether it did.

    Compare-and-set on the status read with the node: a node that is online (or draining, an
    operator's decision a heartbeat must not undo) costs one UPDATE. A status that changed
    since it was read (the reaper marked it offline meanwhile) takes the slow path.
    """
    if node.status not in _RETURNING:
        seen = Node.objects.filter(pk=node.pk, status=node.status).update(last_heartbeat_at=now)
        if seen:
            node.last_heartbeat_at = now
            return False
    came_back = Node.objects.filter(pk=node.pk, status__in=_RETURNING).update(
        status=NodeStatus.ONLINE, last_heartbeat_at=now
    )
    if not came_back:
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now)
    node.refresh_from_db(fields=["status", "last_heartbeat_at", "inventory_hash"])
    return bool(came_back)


# The states a heartbeat brings a node online from: its table's, except a drain, which a
# heartbeat never undoes.
_RETURNING = NODE_LIFECYCLE.sources(NodeStatus.ONLINE) - {NodeStatus.DRAINING}
# The states a heartbeat leaves as they are (it only refreshes ``last_heartbeat_at``).
_STEADY = frozenset(str(s) for s in NodeStatus) - {str(s) for s in _RETURNING}


def _listening_long_enough(now: datetime, grace: timedelta) -> bool:
    """Whether the control plane has been up to hear heartbeats for a whole grace period.

    The reaper runs every heartbeat interval. A gap longer than the grace period since its last
    run means the control plane itself was away (its worker or beat down, or everything): the
    nodes could not be heard, so each gets a fresh grace period from now before it is judged.
    An agent that backed off while we were down (up to 30 s) is not marked lost for our outage.
    """
    last = Clock.objects.filter(name="reaper-ran").values_list("at", flat=True).first()
    Clock.objects.update_or_create(name="reaper-ran", defaults={"at": now})
    if last is None or now - last > grace:
        Clock.objects.update_or_create(name="reaper-resumed", defaults={"at": now})
        return False
    resumed = Clock.objects.filter(name="reaper-resumed").values_list("at", flat=True).first()
    return resumed is None or now - resumed >= grace


def mark_lost_nodes() -> list[int]:
    """Mark nodes offline whose last heartbeat is older than the grace period, once the
    control plane has itself been listening for that long."""
    now = timezone.now()
    if not _listening_long_enough(now, Node.heartbeat_grace()):
        return []
    cutoff = now - Node.heartbeat_grace()
    lost: list[int] = []
    candidates = Node.objects.filter(status=NodeStatus.ONLINE, last_heartbeat_at__lt=cutoff)
    for node_id in candidates.values_list("pk", flat=True):
        with transaction.atomic(durable=True):
            changed = Node.objects.filter(
                pk=node_id, status=NodeStatus.ONLINE, last_heartbeat_at__lt=cutoff
            ).update(status=NodeStatus.OFFLINE)
            if changed:
                node = Node.objects.get(pk=node_id)
                audit.record(InventoryAuditAction.NODE_OFFLINE, node, acting_user="reaper")
                signals.node_lost.send(Node, node=node)
                lost.append(node_id)
    return lost


# Rows deleted per statement by the prune: at 5,000 nodes every 10 s an hour's expiry is
# 1.8 million rows, which one DELETE would hold in one long transaction.
PRUNE_BATCH = 10_000


def prune_heartbeats(retention_hours: int, batch: int = PRUNE_BATCH) -> int:
    """Delete heartbeats older than the retention, ``batch`` rows per transaction (found
    through the BRIN index on ``received_at`` on PostgreSQL, migration 0002)."""
    cutoff = timezone.now() - timedelta(hours=retention_hours)
    expired = Heartbeat.objects.filter(received_at__lt=cutoff).order_by()
    total = 0
    while True:
        ids = list(expired.values_list("pk", flat=True)[:batch])
        if not ids:
            return total
        deleted, _ = Heartbeat.objects.filter(pk__in=ids).delete()
        total += deleted
