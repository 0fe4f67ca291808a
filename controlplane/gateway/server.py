"""The gateway's HTTP side: the machine requests it answers, and a proxy for the rest.

It answers, for an active machine token of the right kind within its rate:

- ``POST nodes/<id>/heartbeat`` from that node's agent, when the node is online or draining
  (a group commit, :class:`~controlplane.gateway.fleet.GroupCommit`);
- ``POST routers/<id>/stats`` from that router's own credential (a group commit too);
- ``PUT nodes/<id>/inventory`` from that node's agent, when the report is the one stored;
- ``GET agent/commands`` when the agent's node has nothing queued for its session, holding a
  long poll (``wait``) in the event loop until a command is queued or the wait ends;
- ``GET routing/policies/<name>`` and ``GET routing/deployments`` from a router: 304 when
  its ``If-None-Match`` names the current ETag, else the control plane's own answer for that
  ETag when the gateway kept one (:class:`RoutingAnswers`).

Everything else, and any of these it is not sure of (a payload its reader refuses, a node
coming back online, a stale snapshot, a failed write), goes to the control plane unchanged,
which answers it as it would without a gateway. A proxied request's own answer is never
retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from django.conf import settings

from common.gc_pauses import CollectionTimes, freeze_heap
from common.inventory import inventory_hash
from common.reports import AGENT_ONLY, CardReport
from controlplane.access.throttling import MachineRateThrottle
from controlplane.core.api import etag_listed
from controlplane.gateway import payloads
from controlplane.gateway.edge import Edge, EdgeLimits, Listener, Reply, Request, connection_cap
from controlplane.gateway.fleet import (
    Credentials,
    Database,
    Machine,
    Statements,
    Watcher,
    heartbeats,
    inventory_hashes,
    router_stats,
)
from controlplane.gateway.upstream import (
    HOP_BY_HOP,
    KEPT_WITHOUT,
    end_to_end,
    upstream_base,
    upstream_url,
)
from loadgen.stats import percentile

log = logging.getLogger("controlplane.gateway")

HEARTBEAT = re.compile(r"/api/v1/nodes/(\d{1,18})/heartbeat/?")
ROUTER_STATS = re.compile(r"/api/v1/routers/(\d{1,18})/stats")
INVENTORY = re.compile(r"/api/v1/nodes/(\d{1,18})/inventory/?")
POLICY = re.compile(r"/api/v1/routing/policies/([-a-zA-Z0-9_]+)")
DEPLOYMENTS = "/api/v1/routing/deployments"
COMMANDS = "/api/v1/agent/commands"
# A heartbeat is a few hundred bytes a card, an inventory a few kilobytes, a router's stats
# under one; a larger body is left to the control plane.
MAX_HEARTBEAT = 256 * 1024
MAX_STATS = 64 * 1024
MAX_INVENTORY = 1024 * 1024
# Connections the kernel holds for the gateway to accept. A fleet reconnecting at once (the
# gateway or the network back) fills a short queue in a moment; each connection it drops
# waits for the client to send its SYN again, 1 s later and then 3 s
# (docs/decisions/0033-gateway-backlog-and-frozen-heap.md). Linux caps this at
# net.core.somaxconn.
BACKLOG = 4096
# Seconds the answers under way get to go out once the gateway stops; a long poll held longer
# is cut off, and its agent asks again.
STOP_GRACE = 10.0
# Seconds a thread holds the GIL before another waiting for it gets it (Python's default
# is 0.005). A tenth of that took the heartbeat p99 at 5,000 agents from 127-139 ms to 85-87
# ms, back to back (docs/decisions/0034-gateway-gil-switch-interval.md).
SWITCH_INTERVAL = 0.0005
SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
)
JSON_FIELDS = (("Content-Type", "application/json"), *SECURITY_HEADERS)


@dataclass(frozen=True)
class Answer:
    """An answer the gateway gives itself, whole."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes = b""


def _json(body: Any, status: int = 200) -> Answer:
    return Answer(status, JSON_FIELDS, json.dumps(body, separators=(",", ":")).encode())


def _error(status: int, code: str, message: str) -> Answer:
    """The control plane's error shape (``controlplane/core/api.py``)."""
    return _json({"error": {"code": code, "message": message}}, status)


def _json_only(accept: str) -> bool:
    """Whether an ``Accept`` header leaves the control plane only JSON to answer with: absent,
    or naming no media type but JSON and wildcards. A browser's (``text/html, */*``) gets the
    browsable API, which is not kept nor served from what was kept."""
    ranges = [r.partition(";")[0].strip().lower() for r in accept.split(",") if r.strip()]
    return all(r in ("*/*", "application/*", "application/json") for r in ranges)


def _as_stored(report: Any) -> dict[str, Any]:
    """An inventory report without the fields only agents use (``AGENT_ONLY``), which the
    serializer drops: what the control plane hashes, if the rest is already in its form."""
    if type(report) is not dict:
        raise TypeError("not an object")
    cards = report.get("accelerators")
    if type(cards) is list:
        dropped = AGENT_ONLY[CardReport]
        cards = [
            {k: v for k, v in card.items() if k not in dropped} if type(card) is dict else card
            for card in cards
        ]
        report = {**report, "accelerators": cards}
    return report


class Throttle:
    """The machine rate limit (``MACHINE_RATE_LIMIT``, the control plane's fixed window) over
    the requests the gateway answers itself, counted in this process: a Redis round trip for
    each would cost more than the answer. A credential over it is handed to the control
    plane, whose own throttle counts what reaches it; so a credential may reach up to twice
    its rate across the two, which is still a loop's or a thief's rate, not a machine's
    (docs/decisions/0030-machine-gateway.md)."""

    def __init__(self) -> None:
        self.window = MachineRateThrottle().window()
        self._counts: dict[int, tuple[float, int]] = {}

    def allow(self, machine: Machine) -> bool:
        if self.window is None:
            return True
        limit, seconds = self.window
        now = time.monotonic()
        ends, count = self._counts.get(machine.credential_id, (0.0, 0))
        if ends <= now:
            if len(self._counts) > 100_000:
                self._counts = {k: v for k, v in self._counts.items() if v[0] > now}
            ends, count = now + seconds, 0
        self._counts[machine.credential_id] = (ends, count + 1)
        return count + 1 <= limit


@dataclass(frozen=True)
class Kept:
    """The control plane's whole 200 answer to a router's GET, for one ETag."""

    etag: str
    headers: tuple[tuple[str, str], ...]  # as it sent them, less hop-by-hop fields and Date
    body: bytes


class RoutingAnswers:
    """The control plane's last answer to each routing GET, kept with its ETag.

    Every router asks again after a change (a policy's new version, a deployment's new
    state), and each got the same answer from the control plane: the body is a function of
    its ETag (a policy's id and version; the deployments' digest). So the first router's
    request goes to the control plane and the gateway keeps its answer; the routers that ask
    meanwhile wait for it, and those after get it while the snapshot still names its ETag.
    A change is then one request to Django, not one a router: 200 routers at once had taken
    the web server from a tenth of a core to a whole one for a second
    (docs/decisions/0032-gateway-keeps-router-answers.md)."""

    MAX_BODY = 1024 * 1024

    def __init__(self) -> None:
        self.kept: dict[str, Kept] = {}
        self.fetching: dict[str, asyncio.Future[None]] = {}

    def current(self, path: str, etag: str) -> Kept | None:
        kept = self.kept.get(path)
        return kept if kept is not None and kept.etag == etag else None

    def claim(self, path: str) -> asyncio.Future[None] | None:
        """A future for the caller to fetch ``path`` under, to :meth:`settle` once its answer
        is kept (or not); None when another request is fetching it already."""
        if path in self.fetching:
            return None
        future = self.fetching[path] = asyncio.get_running_loop().create_future()
        return future

    async def wait(self, path: str, within: float) -> None:
        """Until the fetch of ``path`` under way is settled, at most ``within`` seconds."""
        if (fetching := self.fetching.get(path)) is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fetching), within)

    def settle(self, path: str, future: asyncio.Future[None]) -> None:
        if self.fetching.get(path) is future:
            del self.fetching[path]
        if not future.done():
            future.set_result(None)

    def keep(self, path: str, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        fields = {name.lower(): value for name, value in headers}
        etag = fields.get("etag", "")
        if status != 200 or not etag or "set-cookie" in fields or "content-encoding" in fields:
            return
        if fields.get("content-type", "").partition(";")[0].strip() != "application/json":
            return
        if len(body) > self.MAX_BODY:
            return
        kept = tuple((k, v) for k, v in headers if k.lower() not in KEPT_WITHOUT)
        self.kept[path] = Kept(etag, kept, body)


class Gateway:
    def __init__(
        self,
        upstream: str,
        *,
        snapshot_interval: float = 0.25,
        credential_ttl: float | None = None,
        read_timeout: float = 10.0,
        idle_timeout: float = 20.0,
        max_connections: int = 16_384,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.upstream_url = upstream_base(self.upstream)
        self.read_timeout = read_timeout
        self.db = Database()
        ttl = settings.TOKEN_LAST_USED_SECONDS if credential_ttl is None else credential_ttl
        self.credentials = Credentials(self.db, ttl)
        self.watcher = Watcher(self.db, snapshot_interval, self.credentials)
        self.statements = Statements()
        self.batcher = heartbeats(self.db, self.statements)
        self.stats = router_stats(self.db, self.statements)
        self.inventories = inventory_hashes(self.db)
        self.throttle = Throttle()
        self.routing = RoutingAnswers()
        self.session: aiohttp.ClientSession | None = None
        self.edge = Edge(
            EdgeLimits(
                max_body=settings.MAX_REQUEST_BODY_BYTES,
                body_limits_by_path=tuple(
                    (path.encode(), limit) for path, limit in settings.BODY_LIMITS_BY_PATH.items()
                ),
                read_timeout=read_timeout,
                idle_timeout=idle_timeout,
                max_connections=max_connections,
            )
        )
        self.server: Listener | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.answered = 0
        self.proxied = 0
        # Seconds from a heartbeat's dispatch to its answer, since the last report.
        self.heartbeat_times: list[float] = []
        # The event loop's longest delay of a timer since the last report (seconds).
        self.lag = 0.0
        # Its garbage collections: the longest since the last report.
        self.collections = CollectionTimes()

    async def start(self, host: str, port: int) -> None:
        """Start the background work, then listen on ``host:port``."""
        self.session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=300),
            # Under the web worker's own keep-alive (gunicorn: 2 s), so a connection it closed
            # is never reused for a request that cannot be retried.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0),
        )
        self._tasks = [
            asyncio.create_task(self.watcher.run(), name="gateway-snapshot"),
            asyncio.create_task(self.batcher.run(), name="gateway-heartbeats"),
            asyncio.create_task(self.stats.run(), name="gateway-router-stats"),
            asyncio.create_task(self.credentials.run(), name="gateway-credentials"),
            asyncio.create_task(self.inventories.run(), name="gateway-inventories"),
            asyncio.create_task(self._report(), name="gateway-report"),
            asyncio.create_task(self._watch_lag(), name="gateway-lag"),
        ]
        gc.callbacks.append(self.collections)
        # Bodies are read whole (within the read timeout), as the web worker reads them.
        self.server = Listener(self.dispatch, self.edge, backlog=BACKLOG, grace=STOP_GRACE)
        await self.server.listen(host, port)

    async def stop(self) -> None:
        """Stop listening, let the answers under way go out (at most ``STOP_GRACE`` seconds),
        then stop the background work and close the database threads' connections."""
        if self.server is not None:
            await self.server.close()
        if self.collections in gc.callbacks:
            gc.callbacks.remove(self.collections)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
        await self.statements.close()
        self.db.close()

    async def _report(self, every: float = 30.0) -> None:
        """What the gateway did, in its log, every ``every`` seconds."""
        while True:
            await asyncio.sleep(every)
            log.info("%s", self.report())

    async def _watch_lag(self, every: float = 0.05) -> None:
        """How late the loop runs a timer: the longest time a request waited for the loop
        itself (a blocking call, or the CPU taken by other processes)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + every
            await asyncio.sleep(every)
            late = loop.time() - due
            self.lag = max(self.lag, late)
            if late > 0.1:
                log.info("the event loop ran %.0f ms late", late * 1000)

    def report(self) -> str:
        """Its counts since it started; its heartbeats' times, its slowest batch, its loop's
        longest lag and its longest garbage collection since the last report."""
        b = self.batcher
        times, self.heartbeat_times = self.heartbeat_times, []
        p50, p99 = (percentile(times, q) * 1000 if times else 0.0 for q in (50, 99))
        (slowest, size), b.slowest = b.slowest, (0.0, 0)
        lag, self.lag = self.lag, 0.0
        collection = self.collections.take_longest()
        return (
            f"answered {self.answered}, handed on {self.proxied}; {b.written} heartbeats in"
            f" {b.batches} batches (largest {b.largest}, {b.write_seconds:.1f} s writing),"
            f" answered in {p50:.0f} / {p99:.0f} ms (p50 / p99 of the last {len(times)});"
            f" slowest batch {slowest * 1000:.0f} ms ({size}); loop lag at most"
            f" {lag * 1000:.0f} ms, longest garbage collection {collection * 1000:.0f} ms;"
            f" {self.stats.written} router stats in {self.stats.batches} batches;"
            f" {self.credentials.calls} credential lookups; {self.watcher.holding()} fetches"
            f" held; {self.server.open_connections if self.server else 0} connections open,"
            f" {self.edge.counts}"
        )

    # --- dispatch --------------------------------------------------------------------------

    async def dispatch(self, request: Request, reply: Reply) -> None:
        path, method = request.path, request.method
        # An answer, or None to hand the request on, or a future to settle once the control
        # plane's answer to it was kept (or not).
        answer: Answer | asyncio.Future[None] | None = None
        if method == "POST" and (match := HEARTBEAT.fullmatch(path)):
            started = time.monotonic()
            answer = await self._heartbeat(request, int(match[1]))
            if answer is not None:
                self.heartbeat_times.append(time.monotonic() - started)
        elif method == "POST" and (match := ROUTER_STATS.fullmatch(path)):
            answer = await self._router_stats(request, int(match[1]))
        elif method == "PUT" and (match := INVENTORY.fullmatch(path)):
            answer = await self._inventory(request, int(match[1]))
        elif method == "GET" and path == COMMANDS:
            answer = await self._commands(request)
        elif method == "GET" and (match := POLICY.fullmatch(path)):
            answer = await self._routing(request, policy=match[1])
        elif method == "GET" and path == DEPLOYMENTS:
            answer = await self._routing(request, policy=None)
        if isinstance(answer, Answer):
            self.answered += 1
            await reply.send(answer.status, answer.headers, answer.body)
            return
        await self.proxy(request, reply, keep=answer)

    async def _machine(self, request: Request, kind: str) -> Machine | None:
        header = request.header("authorization").split()
        if len(header) != 2 or header[0] != "Bearer":
            return None
        try:
            machine = await self.credentials.get(header[1])
        except Exception as exc:
            log.warning("credential lookup failed, handing the request on: %s", exc)
            return None
        if machine is None or machine.kind != kind:
            return None
        return machine

    async def _agent_report(
        self, request: Request, node_id: int, limit: int
    ) -> tuple[Machine, Any] | None:
        """An agent's JSON report on its own node: the agent and the parsed body; None to
        hand the request on."""
        machine = await self._machine(request, "agent")
        if machine is None or machine.node_id != node_id:
            return None
        return self._machine_report(request, machine, limit)

    @staticmethod
    def _machine_report(
        request: Request, machine: Machine, limit: int
    ) -> tuple[Machine, Any] | None:
        """A machine's JSON body, parsed, with the machine; None to hand the request on."""
        length = request.content_length
        if length is None or length > limit or request.content_type != "application/json":
            return None
        data = payloads.document(request.header("content-type"), request.body)
        return None if data is None else (machine, data)

    async def _heartbeat(self, request: Request, node_id: int) -> Answer | None:
        report = await self._agent_report(request, node_id, MAX_HEARTBEAT)
        if report is None:
            return None
        machine, data = report
        payload = payloads.heartbeat(data)
        if payload is None or not self.throttle.allow(machine):
            return None
        seen = await self.batcher.submit(node_id, (node_id, payload))
        if seen is None:
            return None
        status, digest = seen
        return _json(
            {
                "status": status,
                "inventory_hash": digest,
                "heartbeat_interval_seconds": settings.HEARTBEAT_INTERVAL_SECONDS,
            }
        )

    async def _router_stats(self, request: Request, router_id: int) -> Answer | None:
        """A router's stats, group-committed. One the control plane would refuse (another
        credential's router, an unknown one, a payload its serializer refuses) goes to it."""
        machine = await self._machine(request, "router")
        if machine is None:
            return None
        report = self._machine_report(request, machine, MAX_STATS)
        if report is None:
            return None
        stats = payloads.router_stats(report[1])
        if stats is None or not self.throttle.allow(machine):
            return None
        owner = (router_id, machine.credential_id)  # its answer is this credential's alone
        if not await self.stats.submit(owner, (*owner, stats)):
            return None
        return _json({"accepted": True})

    async def _inventory(self, request: Request, node_id: int) -> Answer | None:
        """An agent's inventory PUT that changes nothing: its hash is the node's stored one.

        The stored hash is of what the control plane's serializer made of an earlier report,
        so a report with that same hash (the same canonical JSON) is one the serializer
        already accepted, and ``apply_inventory`` would find it unchanged and write nothing.
        Anything else (a changed inventory, a report in another form) goes to the control
        plane."""
        report = await self._agent_report(request, node_id, MAX_INVENTORY)
        if report is None:
            return None
        machine, data = report
        try:
            digest = inventory_hash(_as_stored(data))
        except (TypeError, ValueError):
            return None
        if not self.throttle.allow(machine) or await self.inventories.get(node_id) != digest:
            return None
        return _json({"changed": False, "inventory_hash": digest})

    async def _commands(self, request: Request) -> Answer | None:
        machine = await self._machine(request, "agent")
        if machine is None or machine.node_id is None:
            return None
        query = payloads.command_query(request.query())
        snapshot = self.watcher.current()
        if query is None or snapshot is None:
            return None
        session, wait = query
        if snapshot.has_commands_for(machine.node_id, session):
            return None
        if not self.throttle.allow(machine):
            return None
        deadline = time.monotonic() + min(wait, settings.AGENT_COMMAND_WAIT_SECONDS)
        token = request.header("authorization").split()[1]
        while (remaining := deadline - time.monotonic()) > 0:
            await self.watcher.hold(machine.node_id, remaining)
            snapshot = self.watcher.current()
            if snapshot is None or snapshot.has_commands_for(machine.node_id, session):
                # The control plane hands it out (or finds nothing, if another took it).
                return None
            if await self.credentials.get(token) != machine:
                break  # revoked while waiting: handed nothing, as the control plane does
        return _json({"commands": []})

    async def _routing(
        self, request: Request, *, policy: str | None
    ) -> Answer | asyncio.Future[None] | None:
        """A router's poll: 304 if it names the current ETag; else the kept answer for it.
        When none is kept, the first request goes to the control plane with a future, to be
        settled once its answer is kept, and those that arrive meanwhile wait for it."""
        snapshot = self.watcher.current()
        if snapshot is None:
            return None
        etag = snapshot.deployments_etag if policy is None else snapshot.policy_etags.get(policy)
        if not etag:
            return None
        machine = await self._machine(request, "router")
        if machine is None or not self.throttle.allow(machine):
            return None
        header = request.header("if-none-match")
        if header and etag_listed(header, etag):
            return Answer(304, (*SECURITY_HEADERS, ("ETag", etag)))
        if request.query_string or not _json_only(request.header("accept")):
            return None  # the control plane may answer in another form (its browsable API)
        path = request.path
        if (kept := self.routing.current(path, etag)) is None:
            if (future := self.routing.claim(path)) is not None:
                return future
            await self.routing.wait(path, self.read_timeout)
            if (kept := self.routing.current(path, etag)) is None:
                return None
        return Answer(200, kept.headers, kept.body)

    # --- the proxy -------------------------------------------------------------------------

    async def proxy(
        self, request: Request, reply: Reply, keep: asyncio.Future[None] | None = None
    ) -> None:
        """Hand the request to the control plane and stream its answer back unchanged. With
        ``keep``, a routing answer is also kept (:class:`RoutingAnswers`), and ``keep``
        settled."""
        try:
            await self._proxy(request, reply, keep)
        finally:
            if keep is not None:
                self.routing.settle(request.path, keep)

    async def _proxy(
        self, request: Request, reply: Reply, keep: asyncio.Future[None] | None
    ) -> None:
        assert self.session is not None
        self.proxied += 1
        headers = end_to_end(request.headers, HOP_BY_HOP | {"x-forwarded-for"})
        forwarded = request.header("x-forwarded-for")
        peer = request.remote
        headers.append(("X-Forwarded-For", f"{forwarded}, {peer}" if forwarded else peer))
        try:
            async with self.session.request(
                request.method,
                upstream_url(self.upstream_url, request),
                headers=headers,
                data=request.body if request.body or request.content_length == 0 else None,
                allow_redirects=False,
            ) as upstream:
                fields = end_to_end(list(upstream.headers.items()), KEPT_WITHOUT)
                if keep is not None:
                    # A routing answer (small) is read whole and kept before any of it is
                    # sent, so the router's next poll finds it kept.
                    body = await upstream.read()
                    self.routing.keep(request.path, upstream.status, fields, body)
                    await reply.send(upstream.status, fields, body)
                    return
                await reply.start(upstream.status, fields, upstream.content_length)
                async for chunk in upstream.content.iter_any():
                    await reply.write(chunk)
                await reply.end()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("control plane failed %s %s: %s", request.method, request.path, exc)
            if reply.started:
                reply.abort()  # part of the answer left already: the client sees it cut off
                return
            error = _error(502, "control_plane_unavailable", "the control plane did not answer")
            await reply.send(error.status, error.headers, error.body)


def serve(
    host: str,
    port: int,
    upstream: str,
    switch_interval: float = SWITCH_INTERVAL,
    max_connections: int = 16_384,
    **options: Any,
) -> None:
    """Run a gateway until SIGINT or SIGTERM, then stop it gracefully."""
    # The database threads wait for the GIL each time a statement returns, while the event
    # loop holds it for up to this long: five times a batch
    # (docs/decisions/0034-gateway-gil-switch-interval.md).
    sys.setswitchinterval(switch_interval)
    cap = connection_cap(max_connections)
    if cap < max_connections:
        log.warning(
            "the open-file limit leaves room for %d client connections, not %d",
            cap,
            max_connections,
        )

    async def main() -> None:
        gateway = Gateway(upstream, max_connections=cap, **options)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        await gateway.start(host, port)
        # What start-up made (Django's models, URLs, settings) is most of the heap.
        freeze_heap()
        log.info("gateway on %s:%d, control plane at %s", host, port, upstream)
        await stopping.wait()
        log.info("stopping")
        await gateway.stop()

    asyncio.run(main())
