"""The routing decisions a router reports counts for (docs/machine-api.md), in display order."""

from __future__ import annotations

DECISIONS = ("gpu-only", "pd", "cpu-only", "rejected")
