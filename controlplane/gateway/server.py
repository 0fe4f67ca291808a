"""The gateway's HTTP side: the machine requests it answers, and a proxy for the rest.

It answers, for an active machine token of the right kind within its rate:

- ``POST nodes/<id>/heartbeat`` from that node's agent, when the node is online or draining
  (the group commit in :class:`~controlplane.gateway.fleet.HeartbeatBatcher`);
- ``PUT nodes/<id>/inventory`` from that node's agent, when the report is the one stored;
- ``GET agent/commands`` when the agent's node has nothing queued for its session, holding a
  long poll (``wait``) in the event loop until a command is queued or the wait ends;
- ``GET routing/policies/<name>`` and ``GET routing/deployments`` from a router whose
  ``If-None-Match`` names the current ETag: 304.

Everything else, and any of these it is not sure of (a payload its reader refuses, a node
coming back online, a stale snapshot, a failed write), goes to the control plane unchanged,
which answers it as it would without a gateway. A proxied request's own answer is never
retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from django.conf import settings

from controlplane.access.throttling import MachineRateThrottle
from controlplane.core.api import etag_listed
from controlplane.gateway import payloads
from controlplane.gateway.fleet import (
    Credentials,
    Database,
    HeartbeatBatcher,
    Machine,
    Watcher,
    inventory_hashes,
)
from syshax.common.inventory import inventory_hash
from syshax.common.reports import AGENT_ONLY, CardReport
from syshax.loadgen.stats import percentile

log = logging.getLogger("controlplane.gateway")

HEARTBEAT = re.compile(r"/api/v1/nodes/(\d{1,18})/heartbeat/?")
INVENTORY = re.compile(r"/api/v1/nodes/(\d{1,18})/inventory/?")
POLICY = re.compile(r"/api/v1/routing/policies/([-a-zA-Z0-9_]+)")
DEPLOYMENTS = "/api/v1/routing/deployments"
COMMANDS = "/api/v1/agent/commands"
# A heartbeat is a few hundred bytes a card, an inventory a few kilobytes; a larger body is
# left to the control plane.
MAX_HEARTBEAT = 256 * 1024
MAX_INVENTORY = 1024 * 1024
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body, separators=(",", ":")).encode(),
        content_type="application/json",
        headers={**SECURITY_HEADERS, **(headers or {})},
    )


def _error(status: int, code: str, message: str) -> web.Response:
    """The control plane's error shape (``controlplane/core/api.py``)."""
    return _json({"error": {"code": code, "message": message}}, status)


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
    (docs/decisions.md)."""

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


class Gateway:
    def __init__(
        self,
        upstream: str,
        *,
        snapshot_interval: float = 0.25,
        credential_ttl: float | None = None,
        read_timeout: float = 10.0,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.read_timeout = read_timeout
        self.db = Database()
        ttl = settings.TOKEN_LAST_USED_SECONDS if credential_ttl is None else credential_ttl
        self.credentials = Credentials(self.db, ttl)
        self.watcher = Watcher(self.db, snapshot_interval, self.credentials)
        self.batcher = HeartbeatBatcher(self.db)
        self.inventories = inventory_hashes(self.db)
        self.throttle = Throttle()
        self.session: aiohttp.ClientSession | None = None
        self.answered = 0
        self.proxied = 0
        # Seconds from a heartbeat's dispatch to its answer, since the last report.
        self.heartbeat_times: list[float] = []

    def app(self) -> web.Application:
        # Bodies are read whole (within the read timeout), as the web worker reads them.
        app = web.Application(client_max_size=settings.MAX_REQUEST_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        app.cleanup_ctx.append(self._background)
        return app

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        self.session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=300),
            # Under the web worker's own keep-alive (gunicorn: 2 s), so a connection it closed
            # is never reused for a request that cannot be retried.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0),
        )
        tasks = [
            asyncio.create_task(self.watcher.run(), name="gateway-snapshot"),
            asyncio.create_task(self.batcher.run(), name="gateway-heartbeats"),
            asyncio.create_task(self.credentials.run(), name="gateway-credentials"),
            asyncio.create_task(self.inventories.run(), name="gateway-inventories"),
            asyncio.create_task(self._report(), name="gateway-report"),
        ]
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.session.close()
        self.db.close()

    async def _report(self, every: float = 30.0) -> None:
        """What the gateway did, in its log, every ``every`` seconds."""
        while True:
            await asyncio.sleep(every)
            log.info("%s", self.report())

    def report(self) -> str:
        """Its counts since it started, and its heartbeats' times since the last report."""
        b = self.batcher
        times, self.heartbeat_times = self.heartbeat_times, []
        p50, p99 = (percentile(times, q) * 1000 if times else 0.0 for q in (50, 99))
        return (
            f"answered {self.answered}, handed on {self.proxied}; {b.heartbeats} heartbeats in"
            f" {b.batches} batches (largest {b.largest}, {b.write_seconds:.1f} s writing),"
            f" answered in {p50:.0f} / {p99:.0f} ms (p50 / p99 of the last {len(times)});"
            f" {self.credentials.calls} credential lookups"
        )

    # --- dispatch --------------------------------------------------------------------------

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        answer: web.StreamResponse | None = None
        if method == "POST" and (match := HEARTBEAT.fullmatch(path)):
            started = time.monotonic()
            answer = await self._heartbeat(request, int(match[1]))
            if answer is not None:
                self.heartbeat_times.append(time.monotonic() - started)
        elif method == "PUT" and (match := INVENTORY.fullmatch(path)):
            answer = await self._inventory(request, int(match[1]))
        elif method == "GET" and path == COMMANDS:
            answer = await self._commands(request)
        elif method == "GET" and (match := POLICY.fullmatch(path)):
            answer = await self._not_modified(request, policy=match[1])
        elif method == "GET" and path == DEPLOYMENTS:
            answer = await self._not_modified(request, policy=None)
        if answer is not None:
            self.answered += 1
            return answer
        return await self.proxy(request)

    async def _machine(self, request: web.Request, kind: str) -> Machine | None:
        header = request.headers.get("Authorization", "").split()
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
        self, request: web.Request, node_id: int, limit: int
    ) -> tuple[Machine, Any] | web.Response | None:
        """An agent's JSON report on its own node: the agent and the parsed body; an error
        answer when the body is too large or too slow; None to hand the request on."""
        machine = await self._machine(request, "agent")
        if machine is None or machine.node_id != node_id:
            return None
        length = request.content_length
        if length is None or length > limit or request.content_type != "application/json":
            return None
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            return machine, json.loads(body)
        except ValueError:
            return None

    async def _heartbeat(self, request: web.Request, node_id: int) -> web.StreamResponse | None:
        report = await self._agent_report(request, node_id, MAX_HEARTBEAT)
        if not isinstance(report, tuple):
            return report
        machine, data = report
        payload = payloads.heartbeat(data)
        if payload is None or not self.throttle.allow(machine):
            return None
        seen = await self.batcher.submit(node_id, payload)
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

    async def _inventory(self, request: web.Request, node_id: int) -> web.StreamResponse | None:
        """An agent's inventory PUT that changes nothing: its hash is the node's stored one.

        The stored hash is of what the control plane's serializer made of an earlier report,
        so a report with that same hash (the same canonical JSON) is one the serializer
        already accepted, and ``apply_inventory`` would find it unchanged and write nothing.
        Anything else (a changed inventory, a report in another form) goes to the control
        plane."""
        report = await self._agent_report(request, node_id, MAX_INVENTORY)
        if not isinstance(report, tuple):
            return report
        machine, data = report
        try:
            digest = inventory_hash(_as_stored(data))
        except (TypeError, ValueError):
            return None
        if not self.throttle.allow(machine) or await self.inventories.get(node_id) != digest:
            return None
        return _json({"changed": False, "inventory_hash": digest})

    async def _commands(self, request: web.Request) -> web.StreamResponse | None:
        machine = await self._machine(request, "agent")
        if machine is None or machine.node_id is None:
            return None
        query = payloads.command_query({k: request.query.getall(k) for k in request.query})
        snapshot = self.watcher.current()
        if query is None or snapshot is None:
            return None
        session, wait = query
        if snapshot.has_commands_for(machine.node_id, session):
            return None
        if not self.throttle.allow(machine):
            return None
        deadline = time.monotonic() + min(wait, settings.AGENT_COMMAND_WAIT_SECONDS)
        token = request.headers["Authorization"].split()[1]
        while (remaining := deadline - time.monotonic()) > 0:
            await self.watcher.next(remaining)
            snapshot = self.watcher.current()
            if snapshot is None or snapshot.has_commands_for(machine.node_id, session):
                # The control plane hands it out (or finds nothing, if another took it).
                return None
            if await self.credentials.get(token) != machine:
                break  # revoked while waiting: handed nothing, as the control plane does
        return _json({"commands": []})

    async def _not_modified(
        self, request: web.Request, *, policy: str | None
    ) -> web.StreamResponse | None:
        header = request.headers.get("If-None-Match")
        if not header:
            return None
        snapshot = self.watcher.current()
        if snapshot is None:
            return None
        etag = snapshot.deployments_etag if policy is None else snapshot.policy_etags.get(policy)
        if not etag or not etag_listed(header, etag):
            return None
        machine = await self._machine(request, "router")
        if machine is None or not self.throttle.allow(machine):
            return None
        return web.Response(status=304, headers={**SECURITY_HEADERS, "ETag": etag})

    # --- the proxy -------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> bytes | web.Response:
        """The whole body, or the error answer when it is too large or too slow."""
        limit = settings.MAX_REQUEST_BODY_BYTES
        if (request.content_length or 0) > limit:
            return _error(
                413,
                "payload_too_large",
                f"request body is {request.content_length} bytes; the limit is {limit} bytes",
            )
        try:
            async with asyncio.timeout(self.read_timeout):
                return await request.read()
        except TimeoutError:
            return _error(
                408,
                "request_timeout",
                f"the request did not arrive whole within {self.read_timeout:g} s",
            )
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413, "payload_too_large", f"request body is over the limit of {limit} bytes"
            )

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """Hand the request to the control plane and stream its answer back unchanged. A
        body a handler already read is not read again (aiohttp keeps it)."""
        assert self.session is not None
        self.proxied += 1
        body = None
        if request.body_exists:
            read = await self._body(request)
            if isinstance(read, web.Response):
                return read
            body = read
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        peer = request.remote or ""
        forwarded = request.headers.get("X-Forwarded-For")
        headers = [(k, v) for k, v in headers if k.lower() != "x-forwarded-for"]
        headers.append(("X-Forwarded-For", f"{forwarded}, {peer}" if forwarded else peer))
        response: web.StreamResponse | None = None
        try:
            async with self.session.request(
                request.method,
                self.upstream + request.raw_path,
                headers=headers,
                data=body,
                allow_redirects=False,
            ) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        response.headers.add(name, value)
                if upstream.content_length is not None:
                    response.content_length = upstream.content_length
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("control plane failed %s %s: %s", request.method, request.path, exc)
            if response is not None and response.prepared:
                # Part of the answer left already: the client sees it cut off, never a hang.
                if request.transport is not None:
                    request.transport.close()
                return response
            return _error(502, "control_plane_unavailable", "the control plane did not answer")


def serve(host: str, port: int, upstream: str, **options: Any) -> None:
    gateway = Gateway(upstream, **options)
    web.run_app(
        gateway.app(),
        host=host,
        port=port,
        access_log=None,
        print=lambda *_: log.info("gateway on %s:%d, control plane at %s", host, port, upstream),
    )
