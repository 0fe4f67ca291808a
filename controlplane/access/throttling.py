"""Each machine credential (an agent's or a router's token) gets its own request rate.

A well-behaved agent heartbeats every few seconds and a router polls twice a second; a
credential far above ``MACHINE_RATE_LIMIT`` (default 20 requests a second) is a loop gone wrong
or a stolen token, and gets 429 with ``Retry-After`` instead of the database's time. People are
not throttled here. The counts live in Django's cache: Redis when ``REDIS_URL`` is set (shared
by every web worker), else each process's memory.

The count is a fixed window that starts at a credential's first request: one Redis round trip
per request (``INCR`` and ``EXPIRE NX`` in one pipeline), where DRF's sliding window reads and
writes a list of timestamps (two round trips;
docs/decisions/0028-fleet-paths-through-django.md). A credential may so send up to twice the
rate across a window's edge, which is still a loop's or a thief's rate, not an agent's.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle

from controlplane.access.principal import MachinePrincipal

log = logging.getLogger(__name__)


def _redis(key: str) -> tuple[Any, str] | None:
    """The Redis client and full key name for ``key``; None for the in-memory cache."""
    backend = caches["default"]
    if not isinstance(backend, RedisCache):
        return None
    name = backend.make_and_validate_key(key)
    # Django keeps its redis-py client private; the pipeline needs it (one round trip).
    return backend._cache.get_client(name, write=True), name


def _count(key: str, seconds: int) -> int:
    """Count one request under ``key``: the requests in its window so far, this one included."""
    redis = _redis(key)
    if redis is None:
        cache = caches["default"]
        cache.add(key, 0, seconds)
        return int(cache.incr(key))
    client, name = redis
    pipe = client.pipeline(transaction=True)
    pipe.incr(name)
    pipe.expire(name, seconds, nx=True)
    count, _ = pipe.execute()
    return int(count)


def _seconds_left(key: str, seconds: int) -> float:
    redis = _redis(key)
    if redis is None:
        return float(seconds)
    client, name = redis
    ttl = client.ttl(name)
    return float(ttl) if ttl and ttl > 0 else float(seconds)


class MachineRateThrottle(SimpleRateThrottle):
    scope = "machine"

    def allow_request(self, request: Request, view: Any) -> bool:
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        # SimpleRateThrottle.__init__ parsed the rate into these (untyped upstream).
        limit, seconds = int(self.num_requests), int(self.duration)  # type: ignore[attr-defined]
        try:
            if _count(key, seconds) <= limit:
                return True
            self.retry_after = max(1.0, _seconds_left(key, seconds))
        except Exception as exc:  # the cache (Redis) is down or frozen: fail open
            log.warning("machine rate limit not checked, its cache failed: %s", exc)
            return True
        return False

    def wait(self) -> float | None:
        return getattr(self, "retry_after", None)

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        user = request.user
        if not isinstance(user, MachinePrincipal):
            return None
        return self.key_for(user.credential.pk)

    @staticmethod
    def key_for(credential_pk: int) -> str:
        """The cache key counting a credential's requests (the machine gateway counts there
        too, so a credential has one rate across both)."""
        return f"throttle-machine-{credential_pk}"

    def window(self) -> tuple[int, int] | None:
        """``(requests, seconds)`` of the configured rate; None when unlimited."""
        if self.rate is None:
            return None
        return int(self.num_requests), int(self.duration)  # type: ignore[attr-defined]
