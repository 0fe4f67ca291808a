"""Standalone mode's policy source: a policy file plus flag overrides, a tenants file and a
deployments file.

The file (JSON or YAML: a mapping of knobs, or ``{"version": n, "knobs": {...}}``) is checked
every 250 ms and reloaded when it changes, and on SIGHUP. It is validated as the control
plane validates policies; an invalid one is logged and counted, and the last good policy
stays. The tenants file (``--tenants-file``: the control plane's ``{"tenants": [...]}``
document, keys as SHA-256 hex) is reloaded the same way and kept the same way when invalid,
and so is the deployments file (``--deployments-file``: the control plane's
``{"deployments": [...]}`` document, ``router.policy.deployments_file``); a set applied
replaces the last through ``RouterState.set_deployments``, which keeps the streams of a
removed engine going.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from common.policy_schema import PolicyError, validate_knobs
from common.tenants import TenantError, TenantRecord, parse_tenants
from router.policy.deployments_file import load_deployments_file
from router.policy.documents import read_document
from router.state import PolicyRecord, Router

log = logging.getLogger("syshax.router")


def load_policy_file(path: str) -> dict[str, Any]:
    data = read_document(path)
    if not isinstance(data, dict):
        raise PolicyError("policy", f"{path} must hold a mapping of knobs")
    return data


def load_tenants_file(path: str) -> list[TenantRecord]:
    """The tenants of a ``{"tenants": [...]}`` file (JSON or YAML); a TenantError naming the
    first bad field, OSError or ValueError for a file that cannot be read."""
    return parse_tenants(read_document(path))


class StandalonePolicy:
    """The policy file plus flag overrides; a bad file is rejected and the old policy kept."""

    def __init__(
        self,
        router: Router,
        path: str | None,
        overrides: dict[str, Any],
        tenants_path: str | None = None,
        deployments_path: str | None = None,
    ) -> None:
        self.router = router
        self.path = path
        self.overrides = overrides
        self.mtime: float | None = None
        self.version = 0
        self.tenants_path = tenants_path
        self.tenants_mtime: float | None = None
        self.deployments_path = deployments_path
        self.deployments_mtime: float | None = None

    def load(self) -> PolicyRecord:
        data: dict[str, Any] = {}
        version = None
        if self.path:
            raw = load_policy_file(self.path)
            if "knobs" in raw:
                version = raw.get("version")
                raw = raw["knobs"]
            data.update(raw)
        data.update(self.overrides)
        knobs = validate_knobs(data, partial=True)
        self.version = version if isinstance(version, int) else self.version + 1
        return PolicyRecord("default", self.version, knobs)

    def reload(self) -> bool:
        try:
            record = self.load()
        except (PolicyError, OSError, ValueError) as exc:
            self.router.metrics.invalid_policies.inc()
            log.error(
                "rejected policy file %s, keeping version %s: %s",
                self.path,
                self.router.state.default_policy().version,
                exc,
            )
            return False
        self.router.state.set_policy(record)
        log.info(
            "applied policy version %s: mode=%s algorithm=%s",
            record.version,
            record.knobs.mode,
            record.knobs.algorithm,
        )
        return True

    def reload_tenants(self) -> bool:
        """Apply the tenants file; an invalid one is logged (naming the field) and the last
        good table stays."""
        if not self.tenants_path:
            return False
        try:
            records = load_tenants_file(self.tenants_path)
        except (TenantError, OSError, ValueError) as exc:
            log.error(
                "rejected tenants file %s, keeping the last good (%d tenants): %s",
                self.tenants_path,
                len(self.router.tenants.records),
                exc,
            )
            return False
        self.router.tenants.set_records(records)
        log.info("applied %d tenant(s) from %s", len(records), self.tenants_path)
        return True

    def reload_deployments(self) -> bool:
        """Apply the deployments file; an invalid one is logged (naming the entry and the
        field), counted, and the last good set stays."""
        if not self.deployments_path:
            return False
        state = self.router.state
        try:
            specs = load_deployments_file(self.deployments_path)
        except (OSError, ValueError) as exc:
            self.router.metrics.invalid_deployments.inc()
            log.error(
                "rejected deployments file %s, keeping the last good (%d deployments): %s",
                self.deployments_path,
                len(state.deployments),
                exc,
            )
            return False
        before = {d.spec.name for d in state.deployments}
        state.set_deployments(specs)
        after = {spec.name for spec in specs}
        log.info(
            "applied %d deployment(s) of %d model(s) from %s (added: %s; removed: %s)",
            len(specs),
            len(state.by_model),
            self.deployments_path,
            ", ".join(sorted(after - before)) or "none",
            ", ".join(sorted(before - after)) or "none",
        )
        return True

    def attach(self, listen_url: str) -> None:
        pass  # nothing to announce: the file and the flags are all there is

    def hangup(self) -> None:
        self.reload()
        self.reload_tenants()
        self.reload_deployments()

    async def run(self) -> None:
        """Reload a file when it changes; checked often so a change lands within 1 s."""
        if not self.path and not self.tenants_path and not self.deployments_path:
            return
        while True:
            await asyncio.sleep(0.25)
            if self.path:
                changed, self.mtime = _changed(self.path, self.mtime)
                if changed:
                    self.reload()
            if self.tenants_path:
                changed, self.tenants_mtime = _changed(self.tenants_path, self.tenants_mtime)
                if changed:
                    self.reload_tenants()
            if self.deployments_path:
                changed, self.deployments_mtime = _changed(
                    self.deployments_path, self.deployments_mtime
                )
                if changed:
                    self.reload_deployments()


def _changed(path: str, seen: float | None) -> tuple[bool, float | None]:
    """Whether the file at ``path`` changed since modification time ``seen``, and its
    time now (``seen`` while it cannot be read)."""
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return False, seen
    return seen is not None and mtime != seen, mtime
