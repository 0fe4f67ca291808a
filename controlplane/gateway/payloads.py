"""The gateway's fast reading of the requests it answers itself.

Each function returns exactly what the control plane returns for the same input (its JSON
parser, ``StrictJSONParser``, then its own validator, a DRF serializer), or None for
anything it is not sure of: the gateway then hands the request to the control plane, whose
parser and serializer stay the one validator and the one voice of every error
(``tests/controlplane/gateway/test_gateway_readers.py`` holds the two to that over generated
payloads). So these may refuse more than the control plane does (a number sent as a string,
a ``true`` for a number, a body in another charset) but never accept anything it refuses,
or read it differently.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from django.utils.http import parse_header_parameters

from common.serving import ServingError, clean_serving
from controlplane.core.parsers import UNSTORABLE, unstorable_text
from controlplane.inventory.api.serializers import MAX_BYTES
from controlplane.routers.choices import DECISIONS

MAX_CARDS = 1024
SESSION = re.compile(r"[A-Za-z0-9_-]{1,64}")
WAIT = re.compile(r"\d{1,3}(\.\d{1,6})?")
MAX_WAIT = 60.0


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")  # as DRF's parser: NaN and the infinities


def _charset(content_type: str) -> str | None:
    """The codec the control plane decodes a body of ``content_type`` with (Django's
    ``request.encoding``: the ``charset`` parameter when Python knows it, else UTF-8), or
    None when it is not JSON."""
    media, params = parse_header_parameters(content_type)
    if media != "application/json":
        return None
    try:
        return codecs.lookup(params.get("charset", "utf-8")).name
    except LookupError:
        return "utf-8"  # a charset Python does not know is ignored


def document(content_type: str, body: bytes) -> Any:
    """The JSON document ``StrictJSONParser`` reads from ``body``, sent as ``content_type``;
    None when it refuses it or may read it otherwise: a body in another charset than UTF-8,
    with a byte-order mark, invalid UTF-8 (``json.loads`` of bytes lets encoded surrogates
    through, and guesses UTF-16 and UTF-32), NaN or an infinity anywhere, NUL or a lone
    surrogate in any string, nesting too deep to parse. A ``null`` body is None too; no
    reader takes one."""
    if _charset(content_type) != "utf-8":
        return None
    try:
        text = body.decode("utf-8")  # strict: DRF's reader decodes so, and keeps a BOM
        data = json.loads(text, parse_constant=_refuse_constant)
        # A strictly decoded body holds neither character raw; only an escape spells one.
        if "\\u" in text and unstorable_text(data):
            return None
    except (ValueError, RecursionError):
        return None
    return data


def _number(value: Any, low: float, high: float) -> float | None:
    """A ``FloatField(min_value=low, max_value=high)``: compared as the float it becomes."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past the largest float: the serializer refuses it
        return None
    return number if math.isfinite(number) and low <= number <= high else None


def _count(value: Any) -> int | None:
    if type(value) is not int or not 0 <= value <= MAX_BYTES:
        return None
    return value


def _text(value: Any, limit: int, *, blank: bool) -> str | None:
    """A ``CharField``. The serializers trim white space (a value with any is left to them)
    and refuse NUL and surrogates."""
    if type(value) is not str or len(value) > limit or value != value.strip():
        return None
    if UNSTORABLE.search(value):
        return None
    return value if value or blank else None


def _reading(card: Any) -> dict[str, Any] | None:
    if type(card) is not dict or "uuid" not in card:
        return None
    uuid = _text(card["uuid"], 128, blank=False)
    utilization = _number(card.get("utilization_percent", 0.0), 0, 100)
    memory = _count(card.get("memory_used_bytes", 0))
    temperature = card.get("temperature_c")
    celsius = None if temperature is None else _number(temperature, -50, 200)
    if uuid is None or utilization is None or memory is None:
        return None
    if temperature is not None and celsius is None:
        return None
    return {
        "uuid": uuid,
        "utilization_percent": utilization,
        "memory_used_bytes": memory,
        "temperature_c": celsius,
    }


def heartbeat(payload: Any) -> dict[str, Any] | None:
    """``HeartbeatInSerializer(data=payload).validated_data``, or None."""
    if type(payload) is not dict:
        return None
    cpu = _number(payload.get("cpu_percent", 0.0), 0, 100)
    used = _count(payload.get("memory_used_bytes", 0))
    total = _count(payload.get("memory_total_bytes", 0))
    digest = _text(payload.get("inventory_hash", ""), 64, blank=True)
    cards = payload.get("accelerators", [])
    if cpu is None or used is None or total is None or digest is None:
        return None
    if type(cards) is not list or len(cards) > MAX_CARDS:
        return None
    readings = [_reading(card) for card in cards]
    if any(reading is None for reading in readings):
        return None
    return {
        "cpu_percent": cpu,
        "memory_used_bytes": used,
        "memory_total_bytes": total,
        "inventory_hash": digest,
        "accelerators": readings,
    }


# Bounds on the router's counters the serializer leaves unbounded: the gateway refuses a
# larger one (the serializer takes it) rather than write what no column was sized for.
MAX_COUNT = 2**63 - 1
# The stats fields that are counts (IntegerField, min 0) and measures (FloatField, min 0).
STATS_COUNTS = ("requests_total", "backend_errors", "fallbacks")
STATS_MEASURES = ("uptime_seconds", "request_rate")
STATS_OPTIONAL = ("ttft_p50_ms", "ttft_p99_ms")  # a measure or null


def _tally(value: Any, known: tuple[str, ...] | None) -> dict[str, int] | None:
    """A ``DictField`` of counts: names (of ``known``, when given) to counts."""
    if type(value) is not dict:
        return None
    for name, count in value.items():
        if known is not None and name not in known:
            return None
        if UNSTORABLE.search(name):  # the control plane's parser refuses it (no column keeps it)
            return None
        if type(count) is not int or not 0 <= count <= MAX_COUNT:
            return None
    return dict(value)


def router_stats(payload: Any) -> dict[str, Any] | None:
    """``StatsSerializer(data=payload).validated_data``, or None."""
    if type(payload) is not dict:
        return None
    stats: dict[str, Any] = {}
    version = payload.get("policy_version")
    if version is not None and (type(version) is not int or not 0 <= version <= 2**31 - 1):
        return None
    stats["policy_version"] = version
    for name in STATS_MEASURES:
        if (measure := _number(payload.get(name, 0.0), 0, math.inf)) is None:
            return None
        stats[name] = measure
    for name in STATS_COUNTS:
        count = payload.get(name, 0)
        if type(count) is not int or not 0 <= count <= MAX_COUNT:
            return None
        stats[name] = count
    for name in STATS_OPTIONAL:
        value = payload.get(name)
        if value is not None and (value := _number(value, 0, math.inf)) is None:
            return None
        stats[name] = value
    decisions = _tally(payload.get("decisions", {}), DECISIONS)
    outcomes = _tally(payload.get("outcomes", {}), None)
    if decisions is None or outcomes is None:
        return None
    stats["decisions"], stats["outcomes"] = decisions, outcomes
    try:
        stats["serving"] = clean_serving(payload.get("serving", {}))
    except ServingError:
        return None
    return stats


def command_query(query: Mapping[str, list[str]]) -> tuple[str, float] | None:
    """``(session, wait)`` as ``CommandFetchSerializer`` reads the query of
    ``GET agent/commands`` (each name to all its values), or None."""
    sessions, waits = query.get("session", []), query.get("wait", ["0"])
    if len(sessions) != 1 or len(waits) != 1 or set(query) - {"session", "wait"}:
        return None
    if not SESSION.fullmatch(sessions[0]) or not WAIT.fullmatch(waits[0]):
        return None
    wait = float(waits[0])
    return (sessions[0], wait) if wait <= MAX_WAIT else None
