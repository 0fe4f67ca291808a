"""Managed mode: register with the control plane, pull deployments and policies, send stats.

Pulls are conditional GETs (``If-None-Match``) every ``poll_interval`` seconds, so a policy
change lands within one interval and an idle poll costs a 304. Whatever was last applied is
kept on disk; when the control plane is down - even across a router restart - the router
keeps serving from that copy. A policy that fails validation is logged and never applied.
The tenant table (``routing/tenants``) is pulled, validated and kept the same way, and the
tenants' usage is reported on the stats interval: deltas kept until the control plane
accepts them, so an outage loses none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp

from common import __version__
from common.files import write_json_atomic
from common.policy_schema import PolicyError
from common.routing import parse_deployments
from common.tenants import TenantError, TenantRecord, parse_tenants
from router.client.tenants import merge_usage
from router.state import ControlPlaneLink, PolicyRecord, Router, parse_policy

log = logging.getLogger("syshax.router")


class StateCache:
    """The last good policies and deployments, written atomically."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "router-state.json"

    def load(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("ignoring unreadable state cache %s: %s", self.path, exc)
            return None
        return data if isinstance(data, dict) else None

    def save(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, data, indent=1, sort_keys=True)


def policy_document(record: PolicyRecord) -> dict[str, Any]:
    return {"name": record.name, "version": record.version, "knobs": record.knobs.as_dict()}


class ControlPlaneClient:
    def __init__(
        self,
        router: Router,
        *,
        base_url: str,
        token: str,
        name: str,
        state_dir: Path,
        listen_url: str = "",
        poll_interval: float = 0.5,
        stats_interval: float = 10.0,
    ) -> None:
        self.router = router
        router.control_plane = ControlPlaneLink(base_url.rstrip("/"), token)
        self.base = base_url.rstrip("/") + "/api/v1/"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.name = name
        self.listen_url = listen_url
        self.cache = StateCache(state_dir)
        self.poll_interval = poll_interval
        self.stats_interval = stats_interval
        self.router_id: int | None = None
        self.etags: dict[str, str] = {}
        self.rejected: dict[str, str] = {}  # url -> ETag of a policy refused as invalid
        self.missing: set[str] = set()  # policy URLs that answered 404
        self.session: aiohttp.ClientSession | None = None
        self.reachable: bool | None = None
        self.registered = False
        self.last_stats = 0.0
        # The tenant table as last applied, for the on-disk copy (None: none yet).
        self.tenants: list[TenantRecord] | None = None
        # Usage deltas not yet accepted by the control plane, by tenant.
        self.unsent_usage: dict[str, dict[str, Any]] = {}
        self.usage_missing = False
        self.usage_on_disk = False  # the state file holds unsent usage

    # -- as the router's policy source (router/policy/source.py: PolicySource) --------------

    def attach(self, listen_url: str) -> None:
        """The listener is bound: register under its URL, serving the cached state meanwhile."""
        self.listen_url = listen_url
        self.restore()

    def hangup(self) -> None:
        # SIGHUP must not kill a managed router; its policy comes from the control plane.
        log.info("SIGHUP ignored: the control plane owns the policy")

    # -- the on-disk copy --------------------------------------------------------------------

    def restore(self) -> bool:
        """Apply the cached state, validating it like a fresh pull. True if anything applied."""
        data = self.cache.load()
        if not data:
            return False
        applied = False
        for doc in (data.get("policies") or {}).values():
            try:
                self.router.state.set_policy(parse_policy(doc))
                applied = True
            except PolicyError as exc:
                log.error("cached policy rejected: %s", exc)
        try:
            specs = parse_deployments({"deployments": data.get("deployments") or []})
            self.router.state.set_deployments(specs)
            applied = applied or bool(specs)
        except ValueError as exc:
            log.error("cached deployments rejected: %s", exc)
        if "tenants" in data:
            try:
                self.apply_tenants(parse_tenants({"tenants": data["tenants"]}))
                applied = True
            except TenantError as exc:
                log.error("cached tenants rejected: %s", exc)
        usage = data.get("unsent_usage")
        if isinstance(usage, dict):
            try:
                merge_usage(self.unsent_usage, usage)
                self.usage_on_disk = bool(usage)
            except (AttributeError, TypeError, ValueError) as exc:
                log.error("cached tenant usage dropped: %s", exc)
        if isinstance(data.get("router_id"), int):
            self.router_id = data["router_id"]
        log.info("restored last good state from %s", self.cache.path)
        return applied

    def persist(self) -> None:
        state = self.router.state
        data: dict[str, Any] = {
            "router_id": self.router_id,
            "saved_at": time.time(),
            "policies": {name: policy_document(r) for name, r in state.policies.items()},
            "deployments": [d.spec.as_api() for d in state.deployments],
        }
        if self.tenants is not None:
            data["tenants"] = [record.as_document() for record in self.tenants]
        if self.unsent_usage:
            data["unsent_usage"] = self.unsent_usage
        self.cache.save(data)
        self.usage_on_disk = bool(self.unsent_usage)

    # -- HTTP --------------------------------------------------------------------------------

    async def _get(self, path: str) -> tuple[int, Any, str | None]:
        assert self.session is not None
        url = self.base + path
        headers = dict(self.headers)
        if url in self.etags:
            headers["If-None-Match"] = self.etags[url]
        async with self.session.get(url, headers=headers) as resp:
            if resp.status == 304:
                return 304, None, self.etags.get(url)
            if resp.status == 404:
                return 404, None, None
            if resp.status != 200:
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message=await resp.text()
                )
            return 200, await resp.json(), resp.headers.get("ETag")

    async def register(self) -> None:
        assert self.session is not None
        body = {"name": self.name, "version": __version__, "listen_url": self.listen_url}
        async with self.session.post(
            self.base + "routers/register", json=body, headers=self.headers
        ) as resp:
            if resp.status not in (200, 201):
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message=await resp.text()
                )
            data = await resp.json()
        self.router_id = int(data["id"])
        log.info(
            "registered with the control plane as router %s (id %s)", self.name, self.router_id
        )

    async def pull_deployments(self) -> bool:
        url = self.base + "routing/deployments"
        status, data, etag = await self._get("routing/deployments")
        if status == 304:
            return False
        if status == 404:
            raise ValueError("the control plane has no routing/deployments endpoint")
        try:
            specs = parse_deployments(data)
        except ValueError as exc:
            log.error("control plane sent invalid deployments, keeping the last good: %s", exc)
            return False
        self.router.state.set_deployments(specs)
        if etag:
            self.etags[url] = etag
        return True

    async def pull_policy(self, name: str) -> bool:
        url = self.base + f"routing/policies/{name}"
        status, data, etag = await self._get(f"routing/policies/{name}")
        if status == 304:
            return False
        if status == 404:
            # A deployment names a policy the control plane does not have (yet): keep what
            # we have for it (or the default) and say so once.
            if url not in self.missing:
                self.missing.add(url)
                log.warning("policy %r not found on the control plane", name)
            return False
        self.missing.discard(url)
        if etag and self.rejected.get(url) == etag:
            return False
        try:
            record = parse_policy(data)
        except PolicyError as exc:
            self.router.metrics.invalid_policies.inc()
            log.error(
                "rejected invalid policy %r (keeping version %s): %s",
                name,
                self.router.state.policies.get(name, self.router.state.default_policy()).version,
                exc,
            )
            if etag:
                self.rejected[url] = etag
            return False
        record = PolicyRecord(name, record.version, record.knobs)
        current = self.router.state.policies.get(name)
        if (
            current is not None
            and current.version == record.version
            and current.knobs == record.knobs
        ):
            if etag:
                self.etags[url] = etag
            return False
        self.router.state.set_policy(record)
        log.info("applied policy %r version %s", name, record.version)
        if etag:
            self.etags[url] = etag
        return True

    def apply_tenants(self, records: list[TenantRecord]) -> None:
        self.router.tenants.set_records(records)
        self.tenants = records

    async def pull_tenants(self) -> bool:
        """The tenant table; True when a new one was applied. A control plane without
        tenants (404) leaves the router on its own keys; an invalid table is never applied."""
        url = self.base + "routing/tenants"
        status, data, etag = await self._get("routing/tenants")
        if status == 304:
            return False
        if status == 404:
            if url not in self.missing:
                self.missing.add(url)
                log.warning(
                    "the control plane serves no routing/tenants (older than this router): "
                    "serving %s",
                    "the last known tenants" if self.tenants else "the router's own key only",
                )
            return False
        self.missing.discard(url)
        if etag and self.rejected.get(url) == etag:
            return False
        try:
            records = parse_tenants(data)
        except TenantError as exc:
            log.error("rejected invalid tenants document, keeping the last good: %s", exc)
            if etag:
                self.rejected[url] = etag
            return False
        if etag:
            self.etags[url] = etag
        if records == self.tenants:
            return False
        self.apply_tenants(records)
        log.info("applied %d tenant(s)", len(records))
        return True

    async def post_usage(self) -> None:
        """Send the tenants' usage since the last accepted report. The deltas are kept
        (and new ones merged in) until a 2xx, and written to the state file meanwhile."""
        assert self.session is not None and self.router_id is not None
        merge_usage(self.unsent_usage, self.router.tenants.take_usage())
        if not self.unsent_usage:
            return
        body = {"tenants": self.unsent_usage}
        try:
            async with self.session.post(
                self.base + f"routers/{self.router_id}/usage", json=body, headers=self.headers
            ) as resp:
                if resp.status == 404 and not self.usage_missing:
                    self.usage_missing = True
                    log.warning("the control plane takes no tenant usage yet; keeping it")
                resp.raise_for_status()
        except BaseException:
            self.persist()
            raise
        # Accepted. Nothing was added to unsent_usage meanwhile (this task alone writes it;
        # new usage waits in router.tenants until the next report).
        self.unsent_usage = {}
        self.usage_missing = False
        if self.usage_on_disk:
            self.persist()  # a restart must not send it again

    async def post_stats(self) -> None:
        assert self.session is not None and self.router_id is not None
        body = self.router.metrics.stats(
            self.router.state.default_policy().version, self.router.state.deployments
        )
        async with self.session.post(
            self.base + f"routers/{self.router_id}/stats", json=body, headers=self.headers
        ) as resp:
            resp.raise_for_status()

    async def sync_once(self) -> None:
        if not self.registered:
            await self.register()
            self.registered = True
        changed = await self.pull_deployments()
        names = {"default"} | {d.spec.policy for d in self.router.state.deployments}
        for name in sorted(names):
            changed = await self.pull_policy(name) or changed
        changed = await self.pull_tenants() or changed
        if changed:
            self.persist()
        if time.monotonic() - self.last_stats >= self.stats_interval:
            self.last_stats = time.monotonic()
            await self.post_usage()
            await self.post_stats()

    async def run(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        try:
            while True:
                try:
                    await self.sync_once()
                    if not self.reachable:
                        log.info("control plane %s reachable", self.base)
                    self.reachable = True
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as exc:
                    if self.reachable is not False:
                        log.warning(
                            "control plane unreachable, serving the last good state: %s", exc
                        )
                    self.reachable = False
                await asyncio.sleep(self.poll_interval)
        finally:
            await self.session.close()
