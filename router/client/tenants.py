"""Who is calling and what they may still ask: the tenant table, API keys and rate limits
(docs/router.md, "Tenants").

Every request the app lets in carries a ``TenantRecord`` (``http[REQUEST_TENANT]``): a
tenant of the control plane's document (``common.tenants``), found by the SHA-256 of the
client's key with one dictionary lookup; the router's own ``--api-key`` and benchmark keys,
compared in constant time, which stand for the tenant ``router-key``; or, on a router with
no key and no tenant at all, ``anonymous``.

Limits are two token buckets per tenant, both refilled continuously:

- RPM: ``rpm_limit`` requests, refilled at ``rpm_limit / 60`` a second. A tenant may send a
  burst of ``rpm_limit`` at once, then ``rpm_limit`` a minute sustained.
- TPM: ``tpm_limit`` tokens, refilled at ``tpm_limit / 60`` a second. A request is charged
  an estimate when it is admitted (its prompt and ``max_tokens``, ``estimate_tokens``) and
  the charge is corrected to the tokens it really used when it is settled, so an
  over-estimate is refunded and an under-estimate is owed (the bucket may go below zero).

A refusal is a 429 whose ``Retry-After`` is the time until the bucket has room. Every
request that reaches admission ends in exactly one of ``settle`` and ``reject``; both count
it per tenant in ``/metrics`` and in the usage deltas the control plane is sent (each router
its own: the control plane adds them up, so a request is reported once).

Given a Redis (``--shared-limits-url``, ``router.client.shared_limits``) the buckets live
there, shared by every router process and replica (``admit_shared``); while Redis is down or
slow the local buckets stand in, each limit divided by the routers last seen.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from common.tenants import ROUTER_KEY_TENANT, TenantRecord, hash_key
from router.client.access import bearer, key_matches
from router.client.errors import RouterError
from router.client.shared_limits import SharedLimits
from router.metrics import RouterMetrics

log = logging.getLogger("syshax.router")

# Where the app middleware keeps the request's tenant (router/api/app.py).
REQUEST_TENANT: web.RequestKey[TenantRecord] = web.RequestKey("syshax.tenant", TenantRecord)
# The header by which the router's own key acts for a tenant (the control plane's batch
# worker sends its tenants' requests so).
TENANT_HEADER = "X-Syshax-Tenant"
ANONYMOUS_TENANT = "anonymous"
# The router's own keys and an open router's callers: no limits, every model and class.
ROUTER_TENANT = TenantRecord(ROUTER_KEY_TENANT)
ANONYMOUS = TenantRecord(ANONYMOUS_TENANT)
# What a request without max_tokens is assumed to generate, for the TPM estimate.
DEFAULT_COMPLETION_ESTIMATE = 256
# Why a tenant's request was refused (the usage report's and the rejections counter's label):
# here at admission (model, rpm, tpm), in the flow control (class, shed, queue-timeout).
REJECTION_REASONS = ("rpm", "tpm", "model", "class", "shed", "queue-timeout")


def estimate_tokens(body_bytes: int, max_tokens: int | None) -> int:
    """A request's TPM charge before it runs: about four bytes of body a prompt token, plus
    what it may generate (``max_tokens``, or ``DEFAULT_COMPLETION_ESTIMATE`` without one)."""
    completion = max_tokens if max_tokens is not None else DEFAULT_COMPLETION_ESTIMATE
    return max(1, body_bytes // 4) + max(0, completion)


def invalid_key() -> RouterError:
    return RouterError(
        401,
        "Incorrect or missing API key",
        type_="invalid_request_error",
        code="invalid_api_key",
    )


@dataclass
class Bucket:
    """A token bucket: ``capacity`` at most, refilled at ``rate`` a second."""

    capacity: float
    rate: float
    level: float
    at: float

    @classmethod
    def per_minute(cls, limit: float, now: float) -> Bucket:
        return cls(float(limit), limit / 60.0, float(limit), now)

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = max(self.at, now)

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` fits (0: it fits now)."""
        self.refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Limits:
    """One tenant's buckets (None: no such limit)."""

    rpm: Bucket | None
    tpm: Bucket | None

    @classmethod
    def of(
        cls, record: TenantRecord, now: float, before: Limits | None = None, share: int = 1
    ) -> Limits:
        """The tenant's buckets, each limit divided by ``share`` (the routers holding the
        limits locally while their shared Redis is away; 1 otherwise)."""

        def bucket(limit: int, old: Bucket | None) -> Bucket | None:
            if not limit:
                return None
            new = Bucket.per_minute(limit / max(1, share), now)
            if old is not None:  # a changed limit keeps what the tenant had used
                old.refill(now)
                new.level = min(old.level, new.capacity)
            return new

        return cls(
            bucket(record.rpm_limit, before.rpm if before else None),
            bucket(record.tpm_limit, before.tpm if before else None),
        )

    def mirror(self, tokens: int, now: float) -> None:
        """Take a request let in by the shared buckets from these local ones too (down to
        empty, no further), so that they hold this router's share of what the tenant has
        used when they stand in: a router falling back under a tenant's flood finds them
        empty rather than hands out a fresh burst, however often Redis comes and goes."""
        for bucket, amount in ((self.rpm, 1), (self.tpm, tokens)):
            if bucket is not None and amount:
                bucket.refill(now)
                bucket.level = max(0.0, bucket.level - amount)


@dataclass
class Admission:
    """A request let in: what it was charged, to settle once it ends."""

    tenant: TenantRecord
    model: str
    charged: int
    limits: Limits | None
    done: bool = False
    # Charged to the shared buckets in Redis (settled there too; ``limits`` mirror them).
    shared: bool = False


def _empty_usage() -> dict[str, Any]:
    return {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "rejected": {}}


def merge_usage(into: dict[str, dict[str, Any]], more: Mapping[str, Mapping[str, Any]]) -> None:
    """Add the usage deltas ``more`` to ``into`` (both ``{tenant: {requests, ..., rejected}}``)."""
    for name, usage in more.items():
        total = into.setdefault(name, _empty_usage())
        for key in ("requests", "prompt_tokens", "completion_tokens"):
            total[key] += int(usage.get(key, 0))
        for reason, count in (usage.get("rejected") or {}).items():
            total["rejected"][reason] = total["rejected"].get(reason, 0) + int(count)


@dataclass
class _Table:
    """One tenant document, indexed: swapped in whole, so a request sees one version."""

    by_hash: dict[str, TenantRecord] = field(default_factory=dict)
    by_name: dict[str, TenantRecord] = field(default_factory=dict)


class Tenants:
    """The tenant table, the router's own keys and every tenant's limits and usage."""

    def __init__(
        self,
        api_key: str | None,
        benchmark_keys: Iterable[str],
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedLimits | None = None,
    ) -> None:
        self.api_key = api_key
        # The router's own keys: --api-key and the benchmark keys, all tenant router-key.
        self.router_keys = (*((api_key,) if api_key else ()), *benchmark_keys)
        self.metrics = metrics
        self.clock = clock
        self._table = _Table()
        self._limits: dict[str, Limits] = {}
        # Usage since the last take_usage(), by tenant.
        self._usage: dict[str, dict[str, Any]] = {}
        # The shared buckets; the local ones then stand in for them at 1/routers.
        self.shared = shared
        if shared is not None:
            shared.on_routers = self._redivide

    # -- the table ---------------------------------------------------------------------------

    @property
    def records(self) -> list[TenantRecord]:
        return list(self._table.by_name.values())

    @property
    def open(self) -> bool:
        """No --api-key and no tenant: every request is let in (as before tenants, a
        benchmark key alone does not close the router)."""
        return not self.api_key and not self._table.by_name

    def set_records(self, records: Iterable[TenantRecord]) -> None:
        """Replace the table. A tenant that stays keeps its buckets (a changed limit keeps
        what it had used); a removed one loses them and its keys stop working at once."""
        was_open = self.open
        table = _Table()
        for record in records:
            table.by_name[record.name] = record
            for digest in record.key_hashes:
                table.by_hash[digest] = record
        self._table = table
        self._limits = self._local_limits(table.by_name.values())
        if self.open and not was_open:
            log.warning(
                "no tenant is left and the router has no --api-key: it is open to every client"
            )

    def _local_limits(self, records: Iterable[TenantRecord]) -> dict[str, Limits]:
        now = self.clock()
        share = self.shared.routers if self.shared is not None else 1
        return {
            record.name: Limits.of(record, now, self._limits.get(record.name), share)
            for record in records
            if record.rpm_limit or record.tpm_limit
        }

    def _redivide(self, routers: int) -> None:
        """The shared Redis counts another number of routers: the local buckets that stand
        in for the shared ones take their new share."""
        self._limits = self._local_limits(self._table.by_name.values())

    def get(self, name: str) -> TenantRecord | None:
        if name == ROUTER_KEY_TENANT:
            return ROUTER_TENANT
        return self._table.by_name.get(name)

    # -- who is calling ----------------------------------------------------------------------

    def authenticate(self, authorization: str) -> TenantRecord:
        """The tenant of an ``Authorization: Bearer KEY`` header; a 401 for a missing,
        unknown or revoked key."""
        token = bearer(authorization)
        # The router's own keys first, every one compared in constant time, as before tenants.
        if token and key_matches(token, self.router_keys):
            return ROUTER_TENANT
        if self.open:
            return ANONYMOUS
        record = self._table.by_hash.get(hash_key(token)) if token else None
        if record is None:
            raise invalid_key()
        return record

    def act_as(self, caller: TenantRecord, name: str) -> TenantRecord:
        """The tenant named by ``X-Syshax-Tenant``: only the router's own key may act for
        another tenant (a 403 for any other caller, or for a tenant the router does not know)."""
        if caller.name != ROUTER_KEY_TENANT:
            raise RouterError(
                403,
                f"{TENANT_HEADER} is for the router's own key; this key may not act for "
                "another tenant",
                param=TENANT_HEADER,
                code="tenant_header_not_allowed",
            )
        record = self.get(name)
        if record is None:
            raise RouterError(
                403,
                f"{TENANT_HEADER} names no tenant this router knows: {name!r}",
                param=TENANT_HEADER,
                code="unknown_tenant",
            )
        return record

    # -- limits ------------------------------------------------------------------------------

    def admit(self, tenant: TenantRecord, model: str | None, token_estimate: int) -> Admission:
        """Let a request in or refuse it: a 403 for a model the tenant may not use, a 429
        with ``retry_after`` when its RPM or TPM bucket has no room. A request that names no
        model (``None``: the pass-through paths, the Batch API) is checked for its RPM only,
        and for its TPM when it is charged tokens. An admission must end in ``settle`` (or
        ``reject`` with it) exactly once."""
        if model is not None and not tenant.allows_model(model):
            self._rejected(tenant.name, "model")
            raise RouterError(
                403,
                f"tenant {tenant.name!r} may not use the model {model!r} "
                f"(its models: {', '.join(tenant.models)})",
                param="model",
                code="model_not_allowed",
            )
        limits = self._limits.get(tenant.name)
        charge = max(0, token_estimate)
        if limits is None:
            return Admission(tenant, model or "", charge, None)
        now = self.clock()
        if limits.rpm is not None:
            wait = limits.rpm.wait(1, now)
            if wait > 0:
                self._rejected(tenant.name, "rpm")
                raise _limited(tenant, "requests", "RPM", tenant.rpm_limit, wait)
        if limits.tpm is not None and charge > 0:
            # A request larger than the whole minute's budget waits for a full bucket
            # instead of never fitting; settle charges what it really used.
            charge = min(charge, max(1, int(limits.tpm.capacity)))
            wait = limits.tpm.wait(charge, now)
            if wait > 0:
                self._rejected(tenant.name, "tpm")
                raise _limited(tenant, "tokens", "TPM", tenant.tpm_limit, wait)
            limits.tpm.take(charge)
        if limits.rpm is not None:
            limits.rpm.take(1)
        return Admission(tenant, model or "", charge, limits)

    async def admit_shared(
        self, tenant: TenantRecord, model: str | None, token_estimate: int
    ) -> Admission:
        """``admit`` against the buckets every router shares, where the router has them and
        Redis answers within its bound; else exactly ``admit``, on the local buckets."""
        shared = self.shared
        if shared is None or tenant.name not in self._limits:
            return self.admit(tenant, model, token_estimate)
        if model is not None and not tenant.allows_model(model):
            return self.admit(tenant, model, token_estimate)  # the 403, counted
        charge = max(0, token_estimate) if tenant.tpm_limit else 0
        verdict = await shared.admit(tenant.name, tenant.rpm_limit, tenant.tpm_limit, charge)
        if verdict is None:
            return self.admit(tenant, model, token_estimate)
        limits = self._limits.get(tenant.name)
        if verdict.reason == "rpm":
            self._rejected(tenant.name, "rpm")
            raise _limited(tenant, "requests", "RPM", tenant.rpm_limit, verdict.value)
        if verdict.reason == "tpm":
            self._rejected(tenant.name, "tpm")
            raise _limited(tenant, "tokens", "TPM", tenant.tpm_limit, verdict.value)
        charged = int(verdict.value)
        if limits is not None:
            limits.mirror(charged, self.clock())
        return Admission(tenant, model or "", charged, limits, shared=True)

    def settle(
        self, admission: Admission, prompt_tokens: int, completion_tokens: int, ok: bool
    ) -> None:
        """A request ended: its TPM charge becomes the tokens it used, and it is counted."""
        if admission.done:
            return
        admission.done = True
        name = admission.tenant.name
        used = max(0, prompt_tokens) + max(0, completion_tokens)
        if admission.shared and self.shared is not None:
            self.shared.settle(name, admission.tenant.tpm_limit, used - admission.charged)
        if admission.limits is not None and admission.limits.tpm is not None:
            bucket = admission.limits.tpm
            if used < admission.charged:
                bucket.give_back(admission.charged - used)
            else:
                bucket.take(used - admission.charged)
        self.metrics.tenant_request(name, "ok" if ok else "error")
        self.metrics.tenant_token_count(name, "prompt", max(0, prompt_tokens))
        self.metrics.tenant_token_count(name, "completion", max(0, completion_tokens))
        usage = self._usage.setdefault(name, _empty_usage())
        usage["requests"] += 1
        usage["prompt_tokens"] += max(0, prompt_tokens)
        usage["completion_tokens"] += max(0, completion_tokens)

    def reject(self, tenant: TenantRecord, reason: str, admission: Admission | None = None) -> None:
        """A request refused after authentication (``class``, ``shed``, ``queue-timeout``).
        Given its admission, the TPM charge is refunded and the admission is over (no
        ``settle`` after); the RPM slot stays used."""
        if admission is not None:
            if admission.done:
                return
            admission.done = True
            if admission.shared and self.shared is not None:
                self.shared.settle(tenant.name, tenant.tpm_limit, -admission.charged)
            if admission.limits is not None and admission.limits.tpm is not None:
                admission.limits.tpm.give_back(admission.charged)
        self._rejected(tenant.name, reason)

    def _rejected(self, name: str, reason: str) -> None:
        self.metrics.tenant_request(name, "rejected")
        self.metrics.tenant_rejection(name, reason)
        rejected = self._usage.setdefault(name, _empty_usage())["rejected"]
        rejected[reason] = rejected.get(reason, 0) + 1

    # -- usage for the control plane ---------------------------------------------------------

    def take_usage(self) -> dict[str, dict[str, Any]]:
        """The usage deltas since the last call (``{tenant: {requests, prompt_tokens,
        completion_tokens, rejected: {reason: n}}}``), and start afresh."""
        usage, self._usage = self._usage, {}
        return usage


def _limited(tenant: TenantRecord, what: str, short: str, limit: int, wait: float) -> RouterError:
    seconds = max(1, math.ceil(wait))
    return RouterError(
        429,
        f"Rate limit reached for tenant {tenant.name!r} on {what} per min ({short}): "
        f"limit {limit}. Please try again in {seconds}s.",
        type_=what,
        code=f"{short.lower()}_limit_exceeded",
        retry_after=wait,
    )
