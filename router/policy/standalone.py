"""Standalone mode's policy source: a policy file plus flag overrides.

The file (JSON or YAML: a mapping of knobs, or ``{"version": n, "knobs": {...}}``) is checked
every 250 ms and reloaded when it changes, and on SIGHUP. It is validated as the control
plane validates policies; an invalid one is logged and counted, and the last good policy
stays.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from common.policy_schema import PolicyError, validate_knobs
from router.state import PolicyRecord, Router

log = logging.getLogger("syshax.router")


def load_policy_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        import json

        data = json.loads(text)
    if not isinstance(data, dict):
        raise PolicyError("policy", f"{path} must hold a mapping of knobs")
    return data


class StandalonePolicy:
    """The policy file plus flag overrides; a bad file is rejected and the old policy kept."""

    def __init__(self, router: Router, path: str | None, overrides: dict[str, Any]) -> None:
        self.router = router
        self.path = path
        self.overrides = overrides
        self.mtime: float | None = None
        self.version = 0

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

    def attach(self, listen_url: str) -> None:
        pass  # nothing to announce: the file and the flags are all there is

    def hangup(self) -> None:
        self.reload()

    async def run(self) -> None:
        """Reload when the file changes; checked often so a change lands within 1 s."""
        if not self.path:
            return
        while True:
            await asyncio.sleep(0.25)
            try:
                mtime = os.stat(self.path).st_mtime_ns
            except OSError:
                continue
            if self.mtime is not None and mtime != self.mtime:
                self.reload()
            self.mtime = mtime
