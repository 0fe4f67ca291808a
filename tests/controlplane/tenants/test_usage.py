"""Usage reports: validated, stored per tenant, router and minute, read back as series."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from common.errors import FieldError
from controlplane.routers.models import RouterInstance
from controlplane.tenants.models import TenantUsage
from controlplane.tenants.usage import parse_report, record_usage, usage_series, usage_totals

NOW = datetime(2026, 3, 1, 12, 30, 20, tzinfo=UTC)


def report(**tenants: dict) -> dict:
    return {"tenants": tenants}


def test_reports_in_one_minute_add_up_and_the_next_minute_gets_its_own_row(
    tenant, router_instance, other_router
) -> None:
    record_usage(
        router_instance,
        report(acme={"requests": 3, "prompt_tokens": 30, "rejected": {"rpm": 2}}),
        now=NOW,
    )
    record_usage(
        router_instance,
        report(acme={"requests": 1, "completion_tokens": 7, "rejected": {"rpm": 1, "tpm": 4}}),
        now=NOW + timedelta(seconds=30),
    )
    record_usage(other_router, report(acme={"requests": 10}), now=NOW)
    record_usage(router_instance, report(acme={"requests": 5}), now=NOW + timedelta(minutes=1))
    row = TenantUsage.objects.get(router=router_instance, minute=NOW.replace(second=0))
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (4, 30, 7)
    assert row.rejected == {"rpm": 3, "tpm": 4}
    assert TenantUsage.objects.count() == 3

    series = usage_series(tenant, "5m", now=NOW + timedelta(minutes=1))
    assert [m for m, _ in series][-2:] == [
        NOW.replace(second=0),
        NOW.replace(second=0) + timedelta(minutes=1),
    ]
    assert [u.requests for _, u in series] == [0, 0, 0, 14, 5]
    assert series[3][1].rejected == {"rpm": 3, "tpm": 4}
    assert len(usage_series(tenant, "1h", now=NOW)) == 60
    assert len(usage_series(tenant, "24h", now=NOW)) == 1440
    totals = usage_totals([tenant], timedelta(hours=1), now=NOW + timedelta(minutes=1))
    assert (totals[tenant.pk].requests, totals[tenant.pk].rejections) == (19, 7)


def test_unknown_tenants_are_dropped_and_the_report_accepted(tenant, router_instance) -> None:
    answer = record_usage(
        router_instance,
        report(acme={"requests": 1}, gone={"requests": 2}, **{"router-key": {}}),
        now=NOW,
    )
    assert answer == {"accepted": ["acme"], "dropped": ["gone", "router-key"]}
    assert TenantUsage.objects.get().requests == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "tenants"),
        ({"tenants": []}, "tenants"),
        ({"tenants": {}, "extra": 1}, "extra"),
        (report(acme=[]), "tenants.acme"),
        (report(acme={"requests": -1}), "tenants.acme.requests"),
        (report(acme={"requests": True}), "tenants.acme.requests"),
        (report(acme={"prompt_tokens": 1.5}), "tenants.acme.prompt_tokens"),
        (report(acme={"completion_tokens": 10**13}), "tenants.acme.completion_tokens"),
        (report(acme={"tokens": 1}), "tenants.acme.tokens"),
        (report(acme={"rejected": []}), "tenants.acme.rejected"),
        (report(acme={"rejected": {"bored": 1}}), "tenants.acme.rejected.bored"),
        (report(acme={"rejected": {"shed": "1"}}), "tenants.acme.rejected.shed"),
    ],
)
def test_a_malformed_report_names_the_field(body, field) -> None:
    with pytest.raises(FieldError) as caught:
        parse_report(body)
    assert caught.value.field == field


def test_a_bad_report_stores_nothing(tenant, router_instance) -> None:
    with pytest.raises(FieldError):
        record_usage(router_instance, report(acme={"requests": 1}, zed={"requests": -1}), now=NOW)
    assert not TenantUsage.objects.exists()


def test_an_unknown_window_is_refused_by_name(tenant) -> None:
    with pytest.raises(FieldError, match="window: must be one of 5m, 1h, 24h"):
        usage_series(tenant, "7d")


def test_a_report_beyond_what_a_router_can_observe_is_refused_and_nothing_stored(
    tenant, router_instance
) -> None:
    with pytest.raises(FieldError) as caught:
        record_usage(router_instance, report(acme={"requests": 10**12}), now=NOW)
    assert caught.value.field == "tenants.acme.requests"
    assert "600000" in str(caught.value)  # 10,000 requests/s over the 60 s floor
    assert not TenantUsage.objects.exists()
    router_instance.refresh_from_db()
    assert router_instance.usage_reported_at is None  # not accepted: the window stays open


def test_the_bound_is_the_time_since_the_last_accepted_report(tenant, router_instance) -> None:
    RouterInstance.objects.filter(pk=router_instance.pk).update(
        registered_at=NOW - timedelta(hours=1)
    )
    # A backlog kept through an hour's outage: plausible, stored.
    backlog = report(acme={"requests": 30_000_000, "prompt_tokens": 10**10})
    assert record_usage(router_instance, backlog, now=NOW)["accepted"] == ["acme"]
    # Ten seconds later the floor (60 s) bounds it: 600,000 requests, 6e8 tokens.
    record_usage(
        router_instance, report(acme={"requests": 600_000}), now=NOW + timedelta(seconds=10)
    )
    with pytest.raises(FieldError) as caught:
        record_usage(
            router_instance,
            report(acme={"completion_tokens": 600_000_001}),
            now=NOW + timedelta(seconds=20),
        )
    assert caught.value.field == "tenants.acme.completion_tokens"
    with pytest.raises(FieldError) as caught:  # many tenants: the router's total is bounded
        record_usage(
            router_instance,
            report(**{f"t{i}": {"requests": 400_000} for i in range(2)}),
            now=NOW + timedelta(seconds=30),
        )
    assert caught.value.field == "tenants"
    assert sum(r.requests for r in TenantUsage.objects.all()) == 30_600_000
