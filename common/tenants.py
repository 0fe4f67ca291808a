"""Tenants: who may call the router, how often, for which models and SLO classes.

The control plane stores tenants and their API keys (hashed; a key is shown once, when it is
issued) and serves the router one document, ``{"tenants": [...]}``, that this module parses
with the same rules on both sides (docs/tenants.md). Pure Python, no Django.

A document's tenant::

    {"name": "acme", "keys": ["<sha256 hex of a key>", ...], "rpm_limit": 600,
     "tpm_limit": 200000, "models": [], "classes": ["standard", "batch"],
     "default_class": "standard"}

``rpm_limit`` and ``tpm_limit`` of 0 mean no limit; an empty ``models`` means every model.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Any

from common.errors import FieldError
from common.policy_schema import SLO_CLASSES

# What an issued key starts with, so a leaked one is recognisable (secret scanners, logs).
KEY_PREFIX = "sk-shx-"
# The name of the tenant the router's own --api-key (and benchmark keys) stand for.
ROUTER_KEY_TENANT = "router-key"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
MAX_LIMIT = 1_000_000_000


class TenantError(FieldError):
    """A tenant document is malformed. ``field`` names the offending field."""


def new_key() -> str:
    """A fresh API key: the prefix and 32 random bytes, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str | bytes) -> str:
    """The stored form of a key: its SHA-256, hex. Keys are 256-bit random, so an unsalted
    fast hash is enough (a leaked table cannot be brute-forced back to a key) and lets the
    router find a key's tenant with one dictionary lookup."""
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class TenantRecord:
    name: str
    key_hashes: frozenset[str] = frozenset()
    rpm_limit: int = 0
    tpm_limit: int = 0
    # Empty: every model the router serves.
    models: tuple[str, ...] = ()
    classes: tuple[str, ...] = SLO_CLASSES
    default_class: str = "standard"

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    def allows_class(self, name: str) -> bool:
        return name in self.classes

    def as_document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "keys": sorted(self.key_hashes),
            "rpm_limit": self.rpm_limit,
            "tpm_limit": self.tpm_limit,
            "models": list(self.models),
            "classes": list(self.classes),
            "default_class": self.default_class,
        }


def _limit(data: dict[str, Any], key: str, where: str) -> int:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TenantError(f"{where}.{key}", f"must be an integer, got {value!r}")
    if not 0 <= value <= MAX_LIMIT:
        raise TenantError(f"{where}.{key}", f"must be between 0 and {MAX_LIMIT}; got {value}")
    return value


def _strings(data: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TenantError(f"{where}.{key}", "must be an array of strings")
    return tuple(value)


def check_classes(classes: tuple[str, ...], default_class: str, where: str = "tenant") -> None:
    """Raise a TenantError unless every class is known and the default is among them."""
    for name in classes:
        if name not in SLO_CLASSES:
            raise TenantError(
                f"{where}.classes", f"unknown class {name!r}; known: {', '.join(SLO_CLASSES)}"
            )
    if not classes:
        raise TenantError(f"{where}.classes", "must name at least one class")
    if default_class not in classes:
        raise TenantError(
            f"{where}.default_class",
            f"must be one of the tenant's classes ({', '.join(classes)}); got {default_class!r}",
        )


def parse_tenant(data: Any, where: str = "tenant") -> TenantRecord:
    if not isinstance(data, dict):
        raise TenantError(where, "must be a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise TenantError(f"{where}.name", "must be 1-63 lower-case letters, digits, '-' or '_'")
    keys = _strings(data, "keys", where)
    for key in keys:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise TenantError(f"{where}.keys", "each key must be a SHA-256 hex digest")
    classes = _strings(data, "classes", where) if "classes" in data else SLO_CLASSES
    default_class = data.get("default_class", "standard")
    if not isinstance(default_class, str):
        raise TenantError(f"{where}.default_class", "must be a string")
    check_classes(classes, default_class, where)
    return TenantRecord(
        name=name,
        key_hashes=frozenset(keys),
        rpm_limit=_limit(data, "rpm_limit", where),
        tpm_limit=_limit(data, "tpm_limit", where),
        models=_strings(data, "models", where),
        classes=classes,
        default_class=default_class,
    )


def parse_tenants(doc: Any) -> list[TenantRecord]:
    """The tenants of a ``{"tenants": [...]}`` document; a TenantError naming the first bad
    field (``tenants[2].rpm_limit``). A key may belong to one tenant only."""
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list):
        raise TenantError("tenants", "must be an object with a 'tenants' array")
    records: list[TenantRecord] = []
    seen_names: set[str] = set()
    seen_keys: set[str] = set()
    for i, item in enumerate(doc["tenants"]):
        record = parse_tenant(item, f"tenants[{i}]")
        if record.name in seen_names:
            raise TenantError(f"tenants[{i}].name", f"duplicate tenant {record.name!r}")
        if record.key_hashes & seen_keys:
            raise TenantError(f"tenants[{i}].keys", "a key belongs to two tenants")
        seen_names.add(record.name)
        seen_keys |= record.key_hashes
        records.append(record)
    return records
