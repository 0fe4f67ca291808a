"""Each machine credential (an agent's or a router's token) gets its own request rate.

A well-behaved agent heartbeats every few seconds and a router polls twice a second; a
credential far above ``MACHINE_RATE_LIMIT`` (default 20 requests a second) is a loop gone wrong
or a stolen token, and gets 429 with ``Retry-After`` instead of the database's time. People are
not throttled here. The counts live in Django's cache: Redis when ``REDIS_URL`` is set (shared
by every web worker), else each process's memory.
"""

from __future__ import annotations

import logging
from typing import Any

from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle

from controlplane.access.principal import MachinePrincipal

log = logging.getLogger(__name__)


class MachineRateThrottle(SimpleRateThrottle):
    scope = "machine"

    def allow_request(self, request: Request, view: Any) -> bool:
        try:
            return bool(super().allow_request(request, view))
        except Exception as exc:  # the cache (Redis) is down or frozen: fail open
            log.warning("machine rate limit not checked, its cache failed: %s", exc)
            return True

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        user = request.user
        if not isinstance(user, MachinePrincipal):
            return None
        return f"throttle-machine-{user.credential.pk}"
