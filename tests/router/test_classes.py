"""Class selection (router/client/classes.py): service_tier and X-Syshax-Class, the tenant's
default and allowed classes, and the engine request's priority field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.routing import DeploymentSpec, schedules_by_priority
from common.tenants import TenantRecord
from router.client.classes import (
    CLASS_HEADER,
    choose_class,
    strip_class_fields,
    with_priority,
)
from router.client.errors import RouterError

ANYONE = TenantRecord("anyone")
BATCH_ONLY = TenantRecord("jobs", classes=("batch",), default_class="batch")


@pytest.mark.parametrize(
    ("tier", "expected"),
    [("priority", "interactive"), ("flex", "batch"), ("default", "standard"), ("auto", "standard")],
)
def test_service_tier_picks_the_class(tier: str, expected: str) -> None:
    assert choose_class(ANYONE, {"service_tier": tier}, {}) == expected


def test_no_tier_is_the_tenants_default_class() -> None:
    assert choose_class(ANYONE, {}, {}) == "standard"
    assert choose_class(ANYONE, {"service_tier": None}, {}) == "standard"
    assert choose_class(BATCH_ONLY, {}, {}) == "batch"
    assert choose_class(BATCH_ONLY, {"service_tier": "auto"}, {}) == "batch"


def test_the_header_overrides_the_tier() -> None:
    assert choose_class(ANYONE, {"service_tier": "flex"}, {CLASS_HEADER: "Interactive"}) == (
        "interactive"
    )
    assert choose_class(ANYONE, {}, {CLASS_HEADER: " batch "}) == "batch"


@pytest.mark.parametrize("tier", ["turbo", "scale", "", 1, ["flex"]])
def test_an_unknown_tier_is_a_400_naming_service_tier(tier: Any) -> None:
    with pytest.raises(RouterError) as info:
        choose_class(ANYONE, {"service_tier": tier}, {})
    err = info.value
    assert (err.status, err.param, err.code) == (400, "service_tier", "invalid_service_tier")
    assert "service_tier" in err.message and "flex" in err.message


def test_an_unknown_class_header_is_a_400_naming_the_header() -> None:
    with pytest.raises(RouterError) as info:
        choose_class(ANYONE, {}, {CLASS_HEADER: "gold"})
    err = info.value
    assert (err.status, err.param, err.code) == (400, CLASS_HEADER, "invalid_class")
    assert "interactive" in err.message


def test_a_class_the_tenant_may_not_use_is_a_403() -> None:
    with pytest.raises(RouterError) as info:
        choose_class(BATCH_ONLY, {"service_tier": "priority"}, {})
    err = info.value
    assert (err.status, err.code, err.param) == (403, "class_not_allowed", "service_tier")
    assert "'jobs'" in err.message and "interactive" in err.message
    with pytest.raises(RouterError) as info:
        choose_class(BATCH_ONLY, {}, {CLASS_HEADER: "standard"})
    assert (info.value.code, info.value.param) == ("class_not_allowed", CLASS_HEADER)


def test_the_class_fields_never_reach_an_engine() -> None:
    body: dict[str, Any] = {"model": "m", "service_tier": "flex", "priority": -5}
    assert strip_class_fields(body) and body == {"model": "m"}
    assert not strip_class_fields(body)


@pytest.mark.parametrize(
    "raw",
    [b'{"model": "m", "prompt": "x"}', b'{"model":"m"}\n', b'  {"a": {"b": 1}}  '],
)
def test_the_priority_is_added_to_the_bytes_as_they_are(raw: bytes) -> None:
    spliced = with_priority(raw, 2)
    assert json.loads(spliced) == {**json.loads(raw), "priority": 2}
    assert with_priority(b"{}", 0) == b'{"priority":0}'


def test_an_engine_schedules_by_priority_only_when_its_arguments_say_so() -> None:
    assert schedules_by_priority(["--scheduling-policy", "priority"])
    assert schedules_by_priority(["--max-num-seqs", "8", "--scheduling-policy=priority"])
    assert not schedules_by_priority(["--scheduling-policy", "fcfs"])
    assert not schedules_by_priority(["--scheduling-policy=priority", "--scheduling-policy=fcfs"])
    assert not schedules_by_priority([])
    assert not schedules_by_priority(["--scheduling-policy"])


def test_the_routing_payload_carries_priority_scheduling() -> None:
    entry = {"id": 1, "name": "d", "model": "m", "gpu_url": "http://g", "cpu_url": None}
    assert DeploymentSpec.from_api(entry).priority_scheduling is False
    spec = DeploymentSpec.from_api({**entry, "priority_scheduling": True})
    assert spec.priority_scheduling and spec.as_api()["priority_scheduling"] is True
    assert DeploymentSpec.from_api(spec.as_api()) == spec
    with pytest.raises(ValueError, match="priority_scheduling"):
        DeploymentSpec.from_api({**entry, "priority_scheduling": "yes"})
