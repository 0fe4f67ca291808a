"""What the gateway knows of the fleet, read from and written to the database: machine
credentials (cached), a snapshot of what routers and idle agents poll for, and the group
commits of heartbeats and routers' stats.

Reads run in a thread of their own with its own Django connection (the ORM is
synchronous), so a slow commit never delays a read. On PostgreSQL the group commits' one
statement each is sent from the event loop over an async connection (:class:`Statements`);
elsewhere they run in a writer thread. The statements are the control plane's own, from its
service functions; nothing here knows a table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import psycopg
from django.db import DatabaseError, InterfaceError, OperationalError, connections

from controlplane.access.authentication import (
    active_machine_credentials,
    credentials_fingerprint,
)
from controlplane.access.models import hash_token
from controlplane.deployments.delivery import queued_sessions
from controlplane.inventory.models import Node
from controlplane.inventory.services import (
    record_steady_heartbeats,
    steady_heartbeats_seen,
    steady_heartbeats_statement,
)
from controlplane.policy.models import SchedulingPolicy
from controlplane.routers.services import (
    deployments_etag,
    record_stats_batch,
    routable_deployments,
    stats_batch_statement,
    stats_batch_stored,
)

log = logging.getLogger("controlplane.gateway")
T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def _job(fn: Callable[..., T], *args: Any) -> T:
    """``fn`` on this thread's connection, opened on first use and then kept. It is not
    checked before each call, as Django checks a request's (``CONN_HEALTH_CHECKS``, a
    ``SELECT 1``): that was a round trip more for every batch, an eighth of the writer's
    time under load (docs/decisions/0038-gateway-writes-from-event-loop.md). A call that
    fails closes it instead, and the next call
    opens another: one failed batch, handed to the control plane, then writes resume."""
    try:
        return fn(*args)
    except Exception:
        with contextlib.suppress(DatabaseError):  # the error to report is the call's
            connections["default"].close()
        raise


class Database:
    def __init__(self) -> None:
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="gateway-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gateway-write")

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._reader, _job, fn, *args)

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._writer, _job, fn, *args)

    def close(self) -> None:
        """Close each thread's connection, then the threads."""
        for pool in (self._reader, self._writer):
            pool.submit(connections.close_all).result(timeout=30)
            pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class Machine:
    """An active machine credential, as the gateway needs it."""

    credential_id: int
    kind: str  # "agent" or "router"
    node_id: int | None


def _lookup(tokens: list[str]) -> dict[str, Machine]:
    return {
        token: Machine(c.pk, str(c.kind), c.node_id)
        for token, c in active_machine_credentials(tokens).items()
    }


class Coalescing:
    """Requests that arrive while one batch is being served wait for the next, so a busy
    gateway makes one database call per batch and an idle one adds no wait."""

    def __init__(self) -> None:
        self._wake = asyncio.Event()

    def _waiting_any(self) -> bool:
        raise NotImplementedError

    async def _serve_batch(self) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting_any():
                await self._serve_batch()


class Batched(Coalescing, Generic[K, V]):
    """Lookups that arrive together, answered by one call of ``fetch`` in the database's
    reader thread (at most ``MAX_BATCH`` keys a call): 5,000 agents starting at once are a
    few queries, not 5,000. ``fetch`` leaves out the keys it finds nothing for."""

    MAX_BATCH = 1000

    def __init__(self, db: Database, fetch: Callable[[list[K]], dict[K, V]]) -> None:
        super().__init__()
        self.db, self.fetch = db, fetch
        self._waiting: dict[K, list[asyncio.Future[V | None]]] = {}
        self.calls = 0

    async def get(self, key: K) -> V | None:
        future: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(future)
        self._wake.set()
        return await future

    def _waiting_any(self) -> bool:
        return bool(self._waiting)

    async def _serve_batch(self) -> None:
        keys = list(self._waiting)[: self.MAX_BATCH]
        batch = {key: self._waiting.pop(key) for key in keys}
        try:
            found = await self.db.read(self.fetch, keys)
            self.calls += 1
        except Exception as exc:
            for futures in batch.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            return
        for key, futures in batch.items():
            self.found(key, found.get(key))
            for future in futures:
                if not future.done():
                    future.set_result(found.get(key))

    def found(self, key: K, value: V | None) -> None:
        """Called with each answer as it arrives (a subclass may keep it)."""


class Credentials(Batched[str, Machine]):
    """Machine tokens to their credentials. A token is looked up once, then its answer kept
    for ``ttl`` seconds or until any machine credential is issued, changed (its kind, node or
    revocation) or deleted (the snapshot's fingerprint changes, at most one snapshot later): a
    revoked or moved token passes the gateway's own answers for up to one snapshot interval
    (docs/decisions/0030-machine-gateway.md). A lookup under way when the cache is dropped
    answers its requests but is not kept: it may have read the credential before its change."""

    MAX_ENTRIES = 50_000

    def __init__(self, db: Database, ttl: float) -> None:
        super().__init__(db, _lookup)
        self.ttl = ttl
        # By the token's hash, so the cache itself holds no secret.
        self._cache: dict[str, tuple[float, Machine | None]] = {}
        self._generation = 0  # how many times the cache was dropped
        self._reading = 0  # the generation the lookup under way began in

    def forget(self) -> None:
        self._cache.clear()
        self._generation += 1

    async def _serve_batch(self) -> None:
        self._reading = self._generation
        await super()._serve_batch()

    async def get(self, key: str) -> Machine | None:
        cached = self._cache.get(hash_token(key))
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        return await super().get(key)

    def found(self, key: str, value: Machine | None) -> None:
        if self._reading != self._generation:
            return  # read before the change that dropped the cache
        now = time.monotonic()
        if len(self._cache) >= self.MAX_ENTRIES:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
        self._cache[hash_token(key)] = (now + self.ttl, value)


@dataclass(frozen=True)
class Snapshot:
    """What routers and idle agents ask about, read once for all of them."""

    taken_at: float  # time.monotonic()
    policy_etags: dict[str, str] = field(default_factory=dict)  # policy name -> its ETag
    deployments_etag: str = ""
    queued: dict[int, set[str]] = field(default_factory=dict)  # see queued_sessions()
    credentials: tuple[Any, ...] = ()  # credentials_fingerprint()

    def has_commands_for(self, node_id: int, session: str) -> bool:
        """Whether a fetch by ``session`` would find a command (it must go to the control
        plane, which hands it out)."""
        return any(held != session for held in self.queued.get(node_id, ()))


def _take_snapshot() -> Snapshot:
    policies = SchedulingPolicy.objects.values_list("name", "pk", "version")
    return Snapshot(
        taken_at=time.monotonic(),
        policy_etags={
            name: SchedulingPolicy.etag_for(pk, version) for name, pk, version in policies
        },
        deployments_etag=deployments_etag(routable_deployments()),
        queued=queued_sessions(),
        credentials=credentials_fingerprint(),
    )


class Watcher:
    """Takes a :class:`Snapshot` every ``interval`` seconds. One older than ``max_age`` is not
    used: the gateway then hands those requests to the control plane.

    Held command fetches wait here by node (:meth:`hold`). A snapshot wakes only the fetches
    it may answer differently: those of nodes with something queued, or every one when the
    credentials changed (a token may have been revoked) or there is no snapshot to answer
    from. The rest stay asleep, so 5,000 held fetches cost nothing between their ends."""

    def __init__(self, db: Database, interval: float, credentials: Credentials) -> None:
        self.db, self.interval, self.credentials = db, interval, credentials
        self.max_age = 2 * interval + 1.0
        self.snapshot: Snapshot | None = None
        self._held: dict[int, set[asyncio.Future[None]]] = {}
        self._woken_with: Snapshot | None = None  # the snapshot the held fetches last saw

    def current(self) -> Snapshot | None:
        snapshot = self.snapshot
        if snapshot is None or time.monotonic() - snapshot.taken_at > self.max_age:
            return None
        return snapshot

    def holding(self) -> int:
        """How many fetches are held."""
        return sum(len(waiters) for waiters in self._held.values())

    async def hold(self, node_id: int, within: float) -> None:
        """Wait until a snapshot may change what a fetch of ``node_id`` would get, at most
        ``within`` seconds."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.setdefault(node_id, set()).add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, within)
        finally:
            waiters = self._held.get(node_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._held[node_id]

    def _wake(self) -> None:
        now, before = self.current(), self._woken_with
        if now is before:
            return  # nothing new to look at (a failed read, the old snapshot still young)
        self._woken_with = now
        if now is None or before is None or now.credentials != before.credentials:
            nodes = list(self._held)
        else:
            nodes = [node for node in now.queued if node in self._held]
        for node in nodes:
            for waiter in self._held.pop(node, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def run(self) -> None:
        failing = False
        while True:
            started = time.monotonic()
            try:
                snapshot = await self.db.read(_take_snapshot)
                if self.snapshot is None or snapshot.credentials != self.snapshot.credentials:
                    self.credentials.forget()
                self.snapshot = snapshot
                if failing:
                    log.info("snapshot taken again")
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("snapshot failed, handing its requests on: %s", exc)
                failing = True
            self._wake()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


def inventory_hashes(db: Database) -> Batched[int, str]:
    """Nodes' stored inventory hashes, read together for the inventory PUTs that arrive
    together (a fleet starting at once)."""

    def fetch(node_ids: list[int]) -> dict[int, str]:
        return dict(Node.objects.filter(pk__in=node_ids).values_list("pk", "inventory_hash"))

    return Batched(db, fetch)


def _timed(
    write: Callable[[list[Any]], dict[Any, Any]], reports: list[Any]
) -> tuple[dict[Any, Any], list[float]]:
    """``write(reports)``, with each statement's wall seconds and then the rest (a
    transaction's begin and commit, and the Python around them)."""
    took: list[float] = []

    def timed(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            took.append(time.perf_counter() - started)

    started = time.perf_counter()
    with connections["default"].execute_wrapper(timed):
        written = write(reports)
    return written, [*took, time.perf_counter() - started - sum(took)]


CONNECT_TIMEOUT = 5  # seconds, unless the database settings say otherwise


class Statements:
    """The group commits' statements on PostgreSQL, sent from the event loop itself over a
    psycopg async connection of the gateway's own (Django's settings, autocommit).

    Through the writer thread, a batch waited for that thread to wake, and then the thread
    and the event loop took turns at Python's GIL for every step of it; under load that
    was more of a batch's time than the database's work
    (docs/decisions/0038-gateway-writes-from-event-loop.md). Here a batch is
    one ``await``. The connection opens on first use; one that fails is closed, and the
    next batch opens another."""

    def __init__(self) -> None:
        self._conn: psycopg.AsyncConnection[Any] | None = None

    @property
    def backend_pid(self) -> int | None:
        conn = self._conn
        return None if conn is None or conn.closed else conn.info.backend_pid

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            params = connections["default"].get_connection_params()
            params.pop("cursor_factory", None)  # Django's own, for its synchronous cursors
            # A database that does not answer fails the batch (handed to the control plane)
            # within this, not after the system's TCP timeout.
            params.setdefault("connect_timeout", CONNECT_TIMEOUT)
            self._conn = await psycopg.AsyncConnection.connect(**params, autocommit=True)
        return self._conn

    async def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        conn = await self._connection()
        try:
            async with conn.cursor() as cursor:
                await cursor.execute(sql, params)
                return await cursor.fetchall()
        except psycopg.DatabaseError as exc:
            # A statement the server refused (a report's data) leaves an autocommit
            # connection as it was; anything else may have broken it.
            if conn.broken or database_down(exc):
                await self.close()
            raise
        except Exception:
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


Write = Callable[[list[Any]], Awaitable[tuple[dict[Any, Any], list[float]]]]


def database_down(exc: BaseException) -> bool:
    """Whether a write failed for the database's sake (unreachable, shutting down, out of
    time or space, locked), which every other batch would share; else it was for a report's
    (its data refused by the database or by the statement's own encoding)."""
    return isinstance(
        exc,
        (
            psycopg.OperationalError,
            psycopg.InterfaceError,
            OperationalError,
            InterfaceError,
            OSError,
            TimeoutError,
        ),
    )


def in_thread(db: Database, fn: Callable[[list[Any]], dict[Any, Any]]) -> Write:
    """A batch written by ``fn`` (a service function on Django's connection) in the
    database's writer thread; its steps are each statement's seconds, then the rest."""

    async def write(reports: list[Any]) -> tuple[dict[Any, Any], list[float]]:
        return await db.write(_timed, fn, reports)

    return write


def in_loop(
    statements: Statements,
    statement: Callable[[list[Any]], tuple[str, dict[str, Any]]],
    read: Callable[[list[tuple[Any, ...]]], Any],
) -> Write:
    """A batch written by a service's statement from the event loop; its steps are the
    seconds to build the statement, then to run it."""

    async def write(reports: list[Any]) -> tuple[dict[Any, Any], list[float]]:
        started = time.perf_counter()
        sql, params = statement(reports)
        built = time.perf_counter()
        rows = await statements.rows(sql, params)
        answered = read(rows)
        ran = time.perf_counter()
        written = answered if isinstance(answered, dict) else dict.fromkeys(answered, True)
        return written, [built - started, ran - built]

    return write


# A report waiting in a group commit: its key, the report, and its request's future.
Pending = tuple[K, Any, "asyncio.Future[V | None]"]


class GroupCommit(Coalescing, Generic[K, V]):
    """A group commit: every report that arrives while one batch is being written goes into
    the next, so a busy fleet costs one database call per batch, not one per report, and an
    idle one adds no wait. An answer leaves only after its batch committed: nothing
    acknowledged is lost if the gateway dies.

    ``write`` takes the batch's reports and answers, for each key it stored, what that
    report's answer needs, with the seconds of its steps; a key it leaves out (or a failed
    write) is None to the caller, whose request then goes to the control plane. A key names
    whose report it is (the node, or the router and the credential that sent it), so one
    request never gets the answer to another's report.

    One bad report never fails the others: a write that fails for a report's sake (not the
    database's, :func:`database_down`) wrote nothing, so its halves are written apart, and
    theirs, down to the report that fails alone and goes to the control plane, which answers
    it as it would without a gateway (``MAX_RETRIES`` writes at most, then the rest go too).
    Each answer comes from the write that held its report."""

    SLOW = 0.1  # a batch that takes longer is logged, with its steps' times
    # Writes after a failed one, a batch: one bad report in 500 takes 2 * 9.
    MAX_RETRIES = 32

    def __init__(self, what: str, write: Write, max_batch: int = 500) -> None:
        super().__init__()
        self.what, self.write, self.max_batch = what, write, max_batch
        self._pending: list[Pending[K, V]] = []
        self.batches = 0
        self.written = 0  # reports stored
        self.failed = 0  # reports whose write failed, handed to the control plane
        self.retries = 0  # writes of a failed batch's parts
        self.write_seconds = 0.0  # wall time spent in the batches' writes
        self.largest = 0
        self.slowest = (0.0, 0)  # the slowest batch since the last report: (seconds, size)

    async def submit(self, key: K, report: Any) -> V | None:
        """What ``write`` answered for ``key`` once its batch is committed; None when it
        was not stored here and must go to the control plane."""
        future: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        self._pending.append((key, report, future))
        self._wake.set()
        return await future

    def _waiting_any(self) -> bool:
        return bool(self._pending)

    async def _serve_batch(self) -> None:
        batch = self._pending[: self.max_batch]
        del self._pending[: self.max_batch]
        started = time.monotonic()
        steps: list[float] = []
        parts, retries = [batch], self.MAX_RETRIES  # a stack: the next part to write last
        while parts:
            part = parts.pop()
            try:
                written, took_steps = await self.write([r for _, r, _ in part])
            except Exception as exc:
                down = database_down(exc)
                if len(part) > 1 and not down and retries >= 2:
                    retries -= 2
                    self.retries += 2
                    half = len(part) // 2
                    parts += [part[half:], part[:half]]
                    continue
                log.warning("%s batch of %d not written: %s", self.what, len(part), exc)
                if down:  # the rest would fail alike: all go to the control plane
                    part = [entry for rest in (part, *parts) for entry in rest]
                    parts = []
                self._settle(part, {})
                self.failed += len(part)
                continue
            steps += took_steps
            self._settle(part, written)
        took = time.monotonic() - started
        if took > self.SLOW:
            log.info(
                "%s batch of %d took %.0f ms (its steps: %s ms)",
                self.what,
                len(batch),
                took * 1000,
                " / ".join(f"{step * 1000:.0f}" for step in steps),
            )
        self.write_seconds += took
        if took > self.slowest[0]:
            self.slowest = (took, len(batch))
        self.batches += 1
        self.largest = max(self.largest, len(batch))

    def _settle(self, part: list[Pending[K, V]], written: dict[Any, Any]) -> None:
        """Answer each report of ``part`` from the write that held it."""
        for key, _, future in part:
            self.written += key in written
            if not future.done():
                future.set_result(written.get(key))


def _on_postgresql() -> bool:
    return bool(connections["default"].vendor == "postgresql")


def heartbeats(db: Database, statements: Statements) -> GroupCommit[int, tuple[str, str]]:
    """Steady heartbeats, keyed by node: each answers its node's ``(status,
    inventory_hash)``. A report is ``(node id, validated payload)``. On PostgreSQL the
    batch's one statement is sent from the loop; elsewhere ``record_steady_heartbeats``
    runs in the writer thread."""
    if _on_postgresql():
        return GroupCommit(
            "heartbeat",
            in_loop(statements, steady_heartbeats_statement, steady_heartbeats_seen),
        )
    return GroupCommit("heartbeat", in_thread(db, record_steady_heartbeats))


def _stats(reports: list[tuple[int, int, dict[str, Any]]]) -> dict[tuple[int, int], bool]:
    return dict.fromkeys(record_stats_batch(reports), True)


def router_stats(db: Database, statements: Statements) -> GroupCommit[tuple[int, int], bool]:
    """Routers' stats, keyed by ``(router id, the id of the credential that sent them)``:
    True for each stored, which only a router's own active credential's reports are. A
    report is ``(router id, credential id, validated stats)``."""
    if _on_postgresql():
        return GroupCommit(
            "router stats", in_loop(statements, stats_batch_statement, stats_batch_stored)
        )
    return GroupCommit("router stats", in_thread(db, _stats))
