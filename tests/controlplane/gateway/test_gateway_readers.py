"""The gateway's fast readers (controlplane/gateway/payloads.py) against the control plane's
own parser and serializers, over generated payloads: the gateway never accepts a body the
control plane refuses, nor reads one differently; within the JSON types each field takes it
accepts exactly what the control plane accepts. Where it refuses more (a number sent as a
string, ``true`` for a number, a padded string, a body in another charset) the request goes
to the control plane, which answers it."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from django.test import RequestFactory
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rest_framework.exceptions import ParseError, UnsupportedMediaType
from rest_framework.request import Request

from common.inventory import inventory_hash
from controlplane.core.parsers import StrictJSONParser
from controlplane.gateway import payloads
from controlplane.gateway.server import _as_stored
from controlplane.inventory.api.serializers import (
    HeartbeatInSerializer,
    InventorySerializer,
)
from controlplane.routers.api.serializers import StatsSerializer
from controlplane.routers.choices import DECISIONS
from tests.controlplane.inventory.test_inventory import KUNPENG as _KUNPENG

Reader = Callable[[Any], dict[str, Any] | None]
KUNPENG: dict[str, Any] = _KUNPENG
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- what the generated payloads are made of -------------------------------------------------

# Strings the serializers trim, refuse (NUL, lone surrogates) or take, and lengths around
# the limits (64: an inventory hash, 128: a card's uuid).
TRICKY = ["\ud800", "\udfff", "\ud83d", "\x00", "a\x00b", " ", " x", "x ", "\u2028", "\ufeff"]
TRICKY += ["é", "\U0001f600", "", "GPU-0", "pd", "ok", "12", "h" * 64, "h" * 65, "u" * 128]
TRICKY += ["u" * 129, "10.0.0.5", "::1", "[::1]", "kp-01.example", "a b"]
CHARS = st.characters(codec=None, exclude_categories=())  # surrogates and controls too
TEXTS = st.one_of(st.sampled_from(TRICKY), st.text(CHARS, max_size=6))
STRIPPED = TEXTS.map(str.strip)
# Integers JSON can carry (under 4,300 digits) and floats, NaN and the infinities included.
INTS = st.one_of(
    st.integers(),
    st.sampled_from([-1, 0, 100, 101, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**400, -(10**400)]),
)
FLOATS = st.one_of(
    st.floats(),
    st.sampled_from([-0.0, 100.0, 100.00000000000001, -50.0, -50.1, 200.0, 1e308]),
)
NUMBERS = st.one_of(INTS, FLOATS)
ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXTS),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXTS, inner, max_size=3)),
    max_leaves=6,
)


def _or_anything(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(strategy, ANY)


def _object(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with any of ``fields``, and maybe fields no serializer reads."""
    known = st.fixed_dictionaries({}, optional=fields)
    unknown = st.dictionaries(TEXTS.filter(lambda k: k not in fields), ANY, max_size=2)
    return st.builds(lambda a, b: {**b, **a}, known, unknown)


def _heartbeats(value: Callable[[st.SearchStrategy[Any]], st.SearchStrategy[Any]]) -> Any:
    """Heartbeats whose fields are ``value(a strategy of the field's own JSON type)``."""
    card = _object(
        {
            "uuid": value(STRIPPED),
            "utilization_percent": value(NUMBERS),
            "memory_used_bytes": value(INTS),
            "temperature_c": value(st.one_of(st.none(), NUMBERS)),
            "simulated": st.booleans(),
        }
    )
    return _object(
        {
            "cpu_percent": value(NUMBERS),
            "memory_used_bytes": value(INTS),
            "memory_total_bytes": value(INTS),
            "inventory_hash": value(STRIPPED),
            "accelerators": value(st.lists(value(card), max_size=3)),
        }
    )


def _stats(value: Callable[[st.SearchStrategy[Any]], st.SearchStrategy[Any]]) -> Any:
    """Routers' stats whose fields are ``value(a strategy of the field's own JSON type)``.
    Counts stay within ``payloads.MAX_COUNT``: the gateway hands a larger one on (a bound
    the serializer does not have)."""
    count = st.integers(max_value=payloads.MAX_COUNT)
    names = st.one_of(st.sampled_from(DECISIONS), TEXTS)
    return _object(
        {
            "policy_version": value(st.one_of(st.none(), INTS)),
            "uptime_seconds": value(NUMBERS),
            "request_rate": value(NUMBERS),
            "requests_total": value(count),
            "backend_errors": value(count),
            "fallbacks": value(count),
            "ttft_p50_ms": value(st.one_of(st.none(), NUMBERS)),
            "ttft_p99_ms": value(st.one_of(st.none(), NUMBERS)),
            "decisions": value(st.dictionaries(names, value(count), max_size=3)),
            "outcomes": value(st.dictionaries(TEXTS, value(count), max_size=3)),
        }
    )


def _as_is(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Each field only of its own JSON type."""
    return strategy


# --- the two sides -----------------------------------------------------------------------------


def _control_plane(serializer: Any, content_type: str, body: bytes) -> dict[str, Any] | None:
    """What the control plane makes of a body: its parser (with Django's reading of the
    charset), then the serializer's ``validated_data``; None where it refuses it."""
    request = RequestFactory().generic("POST", "/", data=body, content_type=content_type)
    try:
        data = Request(request, parsers=[StrictJSONParser()]).data
    except (ParseError, UnsupportedMediaType, RecursionError):
        return None
    validator = serializer(data=data)
    return validator.validated_data if validator.is_valid() else None


def _gateway(reader: Reader, content_type: str, body: bytes) -> dict[str, Any] | None:
    data = payloads.document(content_type, body)
    return None if data is None else reader(data)


def _canonical(data: Any) -> str:
    """Types included: 1 and 1.0 differ."""
    return json.dumps(data, sort_keys=True)


def _agree(ours: dict[str, Any] | None, theirs: dict[str, Any] | None, case: Any) -> None:
    """The gateway accepts only what the control plane accepts, and reads it the same."""
    if ours is not None:
        assert theirs is not None, case
        assert _canonical(ours) == _canonical(theirs), case


@st.composite
def _bodies(draw: Any, payload: st.SearchStrategy[Any]) -> tuple[str, bytes]:
    return _encoded(draw, draw(payload))


def _encoded(draw: Any, payload: Any) -> tuple[str, bytes]:
    """``payload`` as a body the way a client may send it: plain UTF-8, with a byte-order
    mark, with surrogates encoded raw (invalid UTF-8), cut short, in UTF-16 or Latin-1 (its
    charset named or not), NaN and the infinities as their tokens."""
    text = json.dumps(payload, ensure_ascii=draw(st.booleans()))
    utf8 = text.encode("utf-8", "surrogatepass")
    form = draw(st.sampled_from(["utf-8", "bom", "cut", "utf-16", "latin-1"]))
    plain = st.sampled_from(
        ["application/json", "application/json; charset=utf-8", "application/json; charset=UTF8"]
    )
    if form == "bom":
        return draw(plain), b"\xef\xbb\xbf" + utf8
    if form == "cut":
        return draw(plain), utf8[:-1]
    if form == "utf-16":
        named = draw(st.booleans())
        return ("application/json; charset=utf-16" if named else "application/json"), (
            text.encode("utf-16", "surrogatepass")
        )
    if form == "latin-1":
        return "application/json; charset=latin-1", text.encode("latin-1", "replace")
    bogus = "application/json; charset=no-such-codec"  # ignored by Django: UTF-8
    return draw(st.one_of(plain, st.just(bogus))), utf8


def _exact(serializer: Any, reader: Reader, payload: Any, *, ascii_only: bool) -> None:
    """Within each field's own JSON type the two accept and refuse the same bodies."""
    body = json.dumps(payload, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    ours = _gateway(reader, "application/json", body)
    theirs = _control_plane(serializer, "application/json", body)
    assert (ours is None) == (theirs is None), (payload, ours, theirs)
    _agree(ours, theirs, payload)


# --- heartbeats --------------------------------------------------------------------------------


@EXAMPLES
@given(_or_anything(_heartbeats(_or_anything)))
@example({"accelerators": [{"uuid": "\ud800"}]})  # the agent token that failed every batch
@example({"cpu_percent": 10**400})  # past the largest float: the reader raised
@example({"inventory_hash": "\udfff"})
def test_the_heartbeat_reader_never_takes_what_the_serializer_refuses(payload: Any) -> None:
    ours = payloads.heartbeat(payload)
    validator = HeartbeatInSerializer(data=copy.deepcopy(payload))
    _agree(ours, validator.validated_data if validator.is_valid() else None, payload)


@EXAMPLES
@given(_bodies(_or_anything(_heartbeats(_or_anything))))
@example(("application/json", b'{"accelerators":[{"uuid":"\\ud800"}]}'))
@example(("application/json", b'{"accelerators":[{"uuid":"\xed\xa0\x80"}]}'))
@example(("application/json", b'\xef\xbb\xbf{"cpu_percent":1}'))
@example(("application/json", '{"cpu_percent":1}'.encode("utf-16")))
@example(("application/json", b'{"cpu_percent":1,"note":NaN}'))
@example(("application/json", b'{"cpu_percent":1,"\\u0000":1}'))
def test_the_gateway_never_takes_a_heartbeat_body_the_control_plane_refuses(
    case: tuple[str, bytes],
) -> None:
    content_type, body = case
    ours = _gateway(payloads.heartbeat, content_type, body)
    _agree(ours, _control_plane(HeartbeatInSerializer, content_type, body), case)


@EXAMPLES
@given(_heartbeats(_as_is), st.booleans())
@example({"accelerators": [{"uuid": "GPU-\ud800"}]}, True)
@example({"accelerators": [{"uuid": f"GPU-{i}"} for i in range(1025)]}, True)
@example({"memory_used_bytes": 2**63}, True)
def test_the_gateway_takes_exactly_the_heartbeats_the_control_plane_takes(
    payload: Any, ascii_only: bool
) -> None:
    _exact(HeartbeatInSerializer, payloads.heartbeat, payload, ascii_only=ascii_only)


def test_the_common_heartbeat_is_the_gateways_own() -> None:
    body = {
        "cpu_percent": 12.5,
        "memory_used_bytes": 3,
        "inventory_hash": "abc",
        "accelerators": [{"uuid": "GPU-0", "utilization_percent": 40, "temperature_c": None}],
    }
    raw = json.dumps(body).encode()
    assert _gateway(payloads.heartbeat, "application/json; charset=utf-8", raw) is not None
    assert _gateway(payloads.heartbeat, "application/json", raw) is not None


def test_a_body_nested_past_the_parsers_depth_is_handed_on() -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    assert payloads.document("application/json", body) is None


# --- routers' stats ----------------------------------------------------------------------------


@EXAMPLES
@given(_or_anything(_stats(_or_anything)))
@example({"outcomes": {"\ud800": 1}})  # the hole: a key no serializer field checks
@example({"request_rate": -(10**400)})
def test_the_stats_reader_never_takes_what_the_serializer_refuses(payload: Any) -> None:
    ours = payloads.router_stats(payload)
    validator = StatsSerializer(data=copy.deepcopy(payload))
    _agree(ours, validator.validated_data if validator.is_valid() else None, payload)


@EXAMPLES
@given(_bodies(_or_anything(_stats(_or_anything))))
@example(("application/json", b'{"outcomes":{"\\ud800":1}}'))
@example(("application/json", b'{"outcomes":{"\xed\xb0\x80":1}}'))
def test_the_gateway_never_takes_a_stats_body_the_control_plane_refuses(
    case: tuple[str, bytes],
) -> None:
    content_type, body = case
    ours = _gateway(payloads.router_stats, content_type, body)
    _agree(ours, _control_plane(StatsSerializer, content_type, body), case)


@EXAMPLES
@given(_stats(_as_is), st.booleans())
@example({"outcomes": {"ok": 1, "\ud800": 2}}, True)
@example({"outcomes": {"x\x00": 1}}, True)
@example({"decisions": {"pd": -1}}, True)
def test_the_gateway_takes_exactly_the_stats_the_control_plane_takes(
    payload: Any, ascii_only: bool
) -> None:
    _exact(StatsSerializer, payloads.router_stats, payload, ascii_only=ascii_only)


def test_a_lone_surrogate_anywhere_is_the_control_planes_400() -> None:
    """Its parser refuses what no column keeps, as it refuses NUL: an outcome's name is
    checked by no serializer field, and PostgreSQL's jsonb cannot hold it."""
    body = b'{"outcomes":{"\\ud800":1}}'
    assert _control_plane(StatsSerializer, "application/json", body) is None
    paired = b'{"outcomes":{"\\ud83d\\ude00":1}}'  # a pair is one character: taken
    assert _control_plane(StatsSerializer, "application/json", paired) is not None
    assert _gateway(payloads.router_stats, "application/json", paired) is not None


# --- inventories -------------------------------------------------------------------------------


def _inventories() -> Any:
    """Inventory reports near a real one: each field kept, dropped or replaced."""

    def near(good: Any, other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(st.just(good), other)

    cpu = KUNPENG["cpu"]
    card = KUNPENG["accelerators"][0]
    cards = st.fixed_dictionaries(
        {
            "kind": near(card["kind"], st.sampled_from(["gpu", "npu", "tpu"])),
            "index": near(0, INTS),
            "uuid": near(card["uuid"], TEXTS),
            "memory_total_bytes": near(card["memory_total_bytes"], NUMBERS),
        },
        optional={
            "vendor": TEXTS,
            "model": TEXTS,
            "simulated": st.booleans(),
            "preset": TEXTS,
        },
    )
    return st.fixed_dictionaries(
        {
            "cpu": st.fixed_dictionaries(
                {
                    "sockets": near(cpu["sockets"], INTS),
                    "physical_cores": near(cpu["physical_cores"], INTS),
                    "threads": near(cpu["threads"], INTS),
                },
                optional={
                    "model": TEXTS,
                    "architecture": TEXTS,
                    "isa_flags": st.lists(TEXTS, max_size=3),
                    "memory_total_bytes": NUMBERS,
                },
            )
        },
        optional={
            "agent_version": TEXTS,
            "hostname": TEXTS,
            "address": TEXTS,
            "numa_nodes": near(KUNPENG["numa_nodes"], st.lists(st.just({"index": 0}))),
            "accelerators": st.lists(cards, max_size=2),
        },
    )


@EXAMPLES
@given(_inventories(), st.data())
def test_the_gateway_answers_an_unchanged_inventory_only_if_the_control_plane_takes_it(
    report: dict[str, Any], data: st.DataObject
) -> None:
    """The gateway answers an inventory PUT itself ("unchanged") only when the body's hash
    is the node's stored one: the hash of what the serializer made of an earlier report.
    Equal hashes are equal canonical JSON, so that body is the stored form itself, less the
    agent-only fields the serializer ignores; and every stored form is one the serializer
    takes again, as it is. So whatever form an agent sends the stored report in, the gateway
    answers it only where the control plane takes it, with the same hash."""
    first = InventorySerializer(data=copy.deepcopy(report))
    if not first.is_valid():
        return
    stored_hash = inventory_hash(first.validated_data)
    stored = json.loads(json.dumps(first.validated_data))
    again = InventorySerializer(data=copy.deepcopy(stored))
    assert again.is_valid(), (report, again.errors)
    assert inventory_hash(again.validated_data) == stored_hash
    resent = copy.deepcopy(stored)  # as the agent sends it: with its own fields
    for card in resent["accelerators"]:
        if data.draw(st.booleans()):
            card["preset"] = data.draw(TEXTS)
    content_type, body = _encoded(data.draw, resent)
    document = payloads.document(content_type, body)
    if document is None or inventory_hash(_as_stored(document)) != stored_hash:
        return  # handed to the control plane
    theirs = _control_plane(InventorySerializer, content_type, body)
    assert theirs is not None and inventory_hash(theirs) == stored_hash, (content_type, body)


def test_an_inventory_body_the_parser_refuses_is_handed_on() -> None:
    report = {**KUNPENG, "hostname": "kp-\ud800"}
    body = json.dumps(report).encode()
    assert payloads.document("application/json", body) is None
    assert _control_plane(InventorySerializer, "application/json", body) is None


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/json; charset=utf-16", "application/json; charset=latin-1"],
)
def test_a_body_in_another_form_is_the_control_planes(content_type: str) -> None:
    assert payloads.document(content_type, b'{"cpu_percent": 1}') is None
