"""Tenant usage: what routers report (deltas since their last accepted report), stored per
tenant, router and minute, and read back as per-minute series and totals (docs/tenants.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from common.errors import FieldError
from controlplane.routers.models import RouterInstance
from controlplane.tenants.choices import REJECT_REASONS, USAGE_WINDOWS
from controlplane.tenants.models import Tenant, TenantUsage

log = logging.getLogger(__name__)

# One report names at most this many tenants, and no count in it exceeds this: more than a
# router serves in a minute by orders of magnitude, and far from the columns' 64-bit limit.
MAX_REPORT_TENANTS = 10_000
MAX_COUNT = 10**12
COUNTS = ("requests", "prompt_tokens", "completion_tokens")

# What one router can observe: a report claims at most these rates over the time since the
# router's last accepted report (or its registration), counted as at least USAGE_FLOOR_SECONDS
# so a router that kept a backlog through an outage can still send it. Far above what one
# router serves, far below what would make the totals meaningless
# (docs/decisions/0057-router-credential-scope-and-usage-bounds.md).
MAX_REQUESTS_PER_SECOND = 10_000
MAX_TOKENS_PER_SECOND = 10_000_000
USAGE_FLOOR_SECONDS = 60.0


@dataclass
class Usage:
    """Counts of one tenant: a report's delta, or a minute's or a window's sum."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def add(self, other: Usage) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        for reason, count in other.rejected.items():
            self.rejected[reason] = self.rejected.get(reason, 0) + count

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def rejections(self) -> int:
        return sum(self.rejected.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "rejected": dict(sorted(self.rejected.items())),
        }

    @classmethod
    def of(cls, row: TenantUsage) -> Usage:
        return cls(row.requests, row.prompt_tokens, row.completion_tokens, dict(row.rejected))


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(where, f"must be a non-negative integer, got {value!r}")
    if not 0 <= value <= MAX_COUNT:
        raise FieldError(where, f"must be between 0 and {MAX_COUNT}; got {value}")
    return value


def parse_report(body: Any) -> dict[str, Usage]:
    """A router's usage report, ``{"tenants": {"<name>": {"requests": int, "prompt_tokens":
    int, "completion_tokens": int, "rejected": {"<reason>": int}}}}`` (an absent count is 0),
    by tenant name; a FieldError naming the first bad field (``tenants.acme.rejected.rpm``)."""
    if not isinstance(body, dict) or not isinstance(body.get("tenants"), dict):
        raise FieldError("tenants", "must be an object of usage by tenant name")
    unknown = sorted(set(body) - {"tenants"})
    if unknown:
        raise FieldError(unknown[0], "unknown field; a report has only 'tenants'")
    tenants = body["tenants"]
    if len(tenants) > MAX_REPORT_TENANTS:
        raise FieldError("tenants", f"at most {MAX_REPORT_TENANTS} tenants; got {len(tenants)}")
    report: dict[str, Usage] = {}
    for name, counts in tenants.items():
        where = f"tenants.{name}"
        if not isinstance(counts, dict):
            raise FieldError(where, "must be an object of counts")
        extra = sorted(set(counts) - {*COUNTS, "rejected"})
        if extra:
            raise FieldError(f"{where}.{extra[0]}", f"unknown count; known: {', '.join(COUNTS)}")
        requests, prompt, completion = (_count(counts.get(c, 0), f"{where}.{c}") for c in COUNTS)
        usage = Usage(requests, prompt, completion)
        rejected = counts.get("rejected", {})
        if not isinstance(rejected, dict):
            raise FieldError(f"{where}.rejected", "must be an object of counts by reason")
        for reason, count in rejected.items():
            if reason not in REJECT_REASONS:
                raise FieldError(
                    f"{where}.rejected.{reason}",
                    f"unknown reason; known: {', '.join(REJECT_REASONS)}",
                )
            usage.rejected[reason] = _count(count, f"{where}.rejected.{reason}")
        report[name] = usage
    return report


def minute_of(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def check_observable(report: dict[str, Usage], seconds: float) -> None:
    """FieldError naming the first figure no router could have observed in ``seconds``:
    a tenant's requests (or refusals, or the report's total) above MAX_REQUESTS_PER_SECOND
    per second, its prompt or completion tokens (or the report's total) above
    MAX_TOKENS_PER_SECOND."""
    requests_limit = int(MAX_REQUESTS_PER_SECOND * seconds)
    tokens_limit = int(MAX_TOKENS_PER_SECOND * seconds)
    total = Usage()
    for name, usage in sorted(report.items()):
        figures = {
            "requests": (usage.requests, requests_limit),
            "prompt_tokens": (usage.prompt_tokens, tokens_limit),
            "completion_tokens": (usage.completion_tokens, tokens_limit),
            "rejected": (usage.rejections, requests_limit),
        }
        for figure, (value, limit) in figures.items():
            if value > limit:
                raise FieldError(f"tenants.{name}.{figure}", _beyond(value, limit, seconds))
        total.add(usage)
    for figure, value, limit in (
        ("requests", total.requests + total.rejections, requests_limit),
        ("tokens", total.tokens, tokens_limit),
    ):
        if value > limit:
            raise FieldError(
                "tenants", f"{figure} of all tenants: {_beyond(value, limit, seconds)}"
            )


def _beyond(value: int, limit: int, seconds: float) -> str:
    return (
        f"{value} is more than one router can observe in the {seconds:.0f} s since its last "
        f"accepted report (at most {limit}: {MAX_REQUESTS_PER_SECOND} requests/s and "
        f"{MAX_TOKENS_PER_SECOND} tokens/s)"
    )


def record_usage(
    router: RouterInstance, body: Any, *, now: datetime | None = None
) -> dict[str, Any]:
    """Add a router's report to this minute's rows, one per tenant, atomically. Tenants the
    control plane does not know (deleted since the router's last poll, or the router's own
    ``router-key``) are dropped with a log line: the report is still accepted, so the router
    does not keep it. Raises FieldError for a malformed report, or one claiming more than the
    router could have observed since its last accepted report (:func:`check_observable`),
    storing nothing."""
    report = parse_report(body)
    now = now or timezone.now()
    minute = minute_of(now)
    known = dict(Tenant.objects.filter(name__in=list(report)).values_list("name", "pk"))
    dropped = sorted(set(report) - set(known))
    with transaction.atomic():
        # Locked: two reports of one router at once are bounded one after the other.
        locked = RouterInstance.objects.select_for_update().get(pk=router.pk)
        since = locked.usage_reported_at or locked.registered_at
        check_observable(report, max((now - since).total_seconds(), USAGE_FLOOR_SECONDS))
        RouterInstance.objects.filter(pk=router.pk).update(usage_reported_at=now)
        # In name order, so two reports that lock the same rows take them in the same order.
        for name in sorted(known):
            delta = report[name]
            row, _ = TenantUsage.objects.select_for_update().get_or_create(
                tenant_id=known[name], router=router, minute=minute
            )
            total = Usage.of(row)
            total.add(delta)
            for count in COUNTS:
                setattr(row, count, getattr(total, count))
            row.rejected = total.rejected
            row.save()
    if dropped:
        log.info("usage of unknown tenants from router %s dropped: %s", router.name, dropped)
    return {"accepted": sorted(known), "dropped": dropped}


def window_of(name: str) -> timedelta:
    try:
        return USAGE_WINDOWS[name]
    except KeyError:
        raise FieldError("window", f"must be one of {', '.join(USAGE_WINDOWS)}") from None


def usage_series(
    tenant: Tenant, window: str, *, now: datetime | None = None
) -> list[tuple[datetime, Usage]]:
    """Every minute of the window, oldest first, the current one last, each with the sum of
    what all routers reported for it (zero where none did)."""
    span = window_of(window)
    last = minute_of(now or timezone.now())
    minutes = int(span / timedelta(minutes=1))
    first = last - timedelta(minutes=minutes - 1)
    series = {first + timedelta(minutes=i): Usage() for i in range(minutes)}
    for row in TenantUsage.objects.filter(tenant=tenant, minute__gte=first, minute__lte=last):
        series[row.minute].add(Usage.of(row))
    return list(series.items())


def usage_totals(
    tenants: Iterable[Tenant], span: timedelta, *, now: datetime | None = None
) -> dict[int, Usage]:
    """Each tenant's sum over the last ``span`` (by pk; a tenant with none has a zero)."""
    ids = [t.pk for t in tenants]
    totals = {pk: Usage() for pk in ids}
    since = minute_of(now or timezone.now()) - span + timedelta(minutes=1)
    for row in TenantUsage.objects.filter(tenant_id__in=ids, minute__gte=since):
        totals[row.tenant_id].add(Usage.of(row))
    return totals
