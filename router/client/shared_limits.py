"""The tenants' RPM/TPM buckets kept in Redis, shared by every router process and replica
(docs/router.md, "Shared limits"; decision record 64).

Each admission is one ``EVALSHA`` of a Lua script that refills a tenant's buckets by Redis's
own clock (``TIME``) and charges them in the same step, so two routers never both take the
last token. A request's TPM correction (``settle``) and refund (``reject``) are a second
script, sent without waiting. Keys are ``syshax:limits:{tenant}:rpm`` and ``...:tpm`` (the
braces keep a tenant's keys in one Redis Cluster slot); a bucket expires when it would be
full again, so a missing key is a full bucket and a flushed Redis loses nothing that matters.

Every router process registers itself in a sorted set with a heartbeat; the count is what
a router divides each limit by when it has to hold them locally. That happens when a call
fails or takes longer than ``timeout``: from then on requests use the local buckets
(``router.client.tenants``) without asking Redis, the metric says so, one warning is
logged, and the heartbeat, which keeps probing, brings the router back once Redis answers
within the bound again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from router.metrics import SharedLimitsMetrics

log = logging.getLogger("syshax.router")

PREFIX = "syshax:limits"
# How long one admission may wait for Redis before the router holds the limits locally.
DEFAULT_TIMEOUT = 0.005
HEARTBEAT_SECONDS = 1.0
# A router that missed this long of heartbeats is no longer counted.
ROUTER_TTL_SECONDS = 5.0
# The heartbeat's own bound: it runs beside the requests, never in front of one.
PROBE_TIMEOUT = 1.0
# Admissions in a row past the bound before the router stops asking Redis (one late answer
# on a busy host is decided locally, alone).
SLOW_IN_A_ROW = 3

# Shared by both scripts: Redis's clock, and a bucket refilled to ``now`` (a missing key is
# a full bucket; a lowered limit caps what was left).
_REFILL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, limit)
  local v = redis.call('HMGET', key, 'level', 'at')
  local lvl, at = tonumber(v[1]), tonumber(v[2])
  if lvl == nil or at == nil then return limit end
  if now > at then lvl = lvl + (now - at) * limit / 60 end
  return math.min(lvl, limit)
end
local function store(key, limit, lvl)
  redis.call('HSET', key, 'level', tostring(lvl), 'at', tostring(now))
  -- gone when it would be full again, and no sooner than a second
  local ms = math.ceil((limit - lvl) * 60000 / limit) + 1000
  redis.call('PEXPIRE', key, ms)
end
"""

# KEYS: rpm, tpm. ARGV: rpm limit, tpm limit (0: none), the request's token charge.
# Answers {'', charged} when let in, {'rpm'|'tpm', seconds until there is room} when not.
ADMIT_SCRIPT = (
    _REFILL
    + """
local rpm, tpm, charge = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r, k
if rpm > 0 then
  r = level(KEYS[1], rpm)
  if r < 1 then return {'rpm', tostring((1 - r) * 60 / rpm)} end
end
if tpm > 0 and charge > 0 then
  charge = math.min(charge, tpm)
  k = level(KEYS[2], tpm)
  if k < charge then return {'tpm', tostring((charge - k) * 60 / tpm)} end
  store(KEYS[2], tpm, k - charge)
else
  charge = 0
end
if r then store(KEYS[1], rpm, r - 1) end
return {'', tostring(charge)}
"""
)

# KEYS: tpm. ARGV: tpm limit, tokens to take (negative: to give back).
SETTLE_SCRIPT = (
    _REFILL
    + """
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
store(KEYS[1], tpm, math.min(tpm, level(KEYS[1], tpm) - delta))
return 1
"""
)

# KEYS: the routers' set. ARGV: this router's id, seconds it stays counted. Answers how many
# routers are counted.
HEARTBEAT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 2000))
return redis.call('ZCARD', KEYS[1])
"""


@dataclass(frozen=True)
class Verdict:
    """Redis's answer to an admission: ``reason`` empty when let in (``charged`` tokens
    taken), else ``rpm`` or ``tpm`` with the seconds until there is room."""

    reason: str
    value: float


class SharedLimits:
    """The limits' Redis: admissions, settlements, this router's heartbeat and whether the
    router is holding the limits locally for now (``local``)."""

    def __init__(
        self,
        url: str,
        metrics: SharedLimitsMetrics,
        timeout: float = DEFAULT_TIMEOUT,
        prefix: str = PREFIX,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        # No retries: a failed call falls back at once, the heartbeat probes again.
        self.redis: Redis = Redis.from_url(
            url,
            retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=PROBE_TIMEOUT,
            socket_timeout=PROBE_TIMEOUT,
        )
        self.metrics = metrics
        self.timeout = timeout
        self.prefix = prefix
        self.heartbeat_seconds = heartbeat_seconds
        self.router_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._admit = self.redis.register_script(ADMIT_SCRIPT)
        self._settle = self.redis.register_script(SETTLE_SCRIPT)
        self._heartbeat = self.redis.register_script(HEARTBEAT_SCRIPT)
        # Optimistic until a call fails: the first request asks Redis.
        self.local = False
        # Routers counted at the last heartbeat that answered (1 until one has).
        self.routers = 1
        # Called with the new count when it changes (the tenants re-divide their limits).
        self.on_routers: Callable[[int], None] = lambda count: None
        self._pending: set[asyncio.Task[Any]] = set()
        self._slow_in_a_row = 0

    def _key(self, tenant: str, limit: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:{limit}"

    # -- the request path --------------------------------------------------------------------

    async def admit(self, tenant: str, rpm: int, tpm: int, charge: int) -> Verdict | None:
        """Charge one request to the tenant's shared buckets; None when the router holds the
        limits locally (Redis failed or was slow now or before, until the heartbeat sees it
        back): the caller then uses its local buckets."""
        if self.local:
            self.metrics.local_admissions.inc()
            return None
        keys = (self._key(tenant, "rpm"), self._key(tenant, "tpm"))
        try:
            async with asyncio.timeout(self.timeout):
                reason, value = await self._admit(keys, (rpm, tpm, charge))
        except TimeoutError as exc:  # past the bound (the script may still have run)
            self.metrics.local_admissions.inc()
            self._slow_in_a_row += 1
            if self._slow_in_a_row >= SLOW_IN_A_ROW:
                self._fall_back(exc)
            return None
        except (RedisError, OSError) as exc:
            self.metrics.local_admissions.inc()
            self._fall_back(exc)
            return None
        self._slow_in_a_row = 0
        return Verdict(reason.decode() if isinstance(reason, bytes) else str(reason), float(value))

    def settle(self, tenant: str, tpm: int, delta: int) -> None:
        """Take ``delta`` more tokens from the tenant's shared TPM bucket (negative: give them
        back), without waiting; lost (and logged at debug) if Redis does not take it."""
        if not tpm or not delta or self.local:
            return
        task = asyncio.get_running_loop().create_task(self._send_settle(tenant, tpm, delta))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_settle(self, tenant: str, tpm: int, delta: int) -> None:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                await self._settle((self._key(tenant, "tpm"),), (tpm, delta))
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("shared limits: a TPM settlement of %s was lost: %r", tenant, exc)

    # -- local or shared ---------------------------------------------------------------------

    def _fall_back(self, exc: BaseException) -> None:
        if self.local:
            return
        self.local = True
        self._slow_in_a_row = 0
        self.metrics.local.set(1)
        self.metrics.fallbacks.inc()
        log.warning(
            "shared limits: Redis %s (%s): holding each tenant's limits locally at 1/%d, the "
            "routers last seen",
            "too slow" if isinstance(exc, TimeoutError) else "unreachable",
            type(exc).__name__,
            self.routers,
        )

    def _shared_again(self) -> None:
        if not self.local:
            return
        self.local = False
        self.metrics.local.set(0)
        log.warning(
            "shared limits: Redis answers again: limits are shared by %d routers", self.routers
        )

    async def beat(self) -> None:
        """One heartbeat: register this router, count the routers, and go back to the shared
        limits when Redis answered within the admission bound."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                count = int(
                    await self._heartbeat(
                        (f"{self.prefix}:routers",), (self.router_id, ROUTER_TTL_SECONDS)
                    )
                )
        except (RedisError, OSError, TimeoutError) as exc:
            self._fall_back(exc)
            return
        count = max(1, count)
        if count != self.routers:
            self.routers = count
            self.on_routers(count)
        self.metrics.routers.set(count)
        fast = time.perf_counter() - started <= self.timeout
        if self.local and fast and await self._load_scripts():
            self._shared_again()

    async def _load_scripts(self) -> bool:
        """Load the request path's scripts (a restarted Redis has forgotten them), so that no
        admission pays for it."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                for script in (self._admit, self._settle):
                    await self.redis.script_load(script.script)
        except (RedisError, OSError, TimeoutError) as exc:
            self._fall_back(exc)
            return False
        return True

    async def start(self) -> None:
        """Before the first request: register, connect and load the scripts (bounded by the
        probe's timeout; a Redis not there yet only means starting on local limits)."""
        await self.beat()
        if not self.local:
            await self._load_scripts()

    async def run(self) -> None:
        """Heartbeats until cancelled."""
        while True:
            await self.beat()
            await asyncio.sleep(self.heartbeat_seconds)

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await self.redis.aclose()
