"""The inventory's identity on the wire: one hash, computed the same way by the agent (to skip
resending an unchanged inventory) and the control plane (to skip rewriting it)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def inventory_hash(inventory: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON (sorted keys, no spaces) of the reported hardware."""
    canonical = json.dumps(inventory, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
