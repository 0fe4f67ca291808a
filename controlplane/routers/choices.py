"""The routing decisions a router reports counts for (docs/machine-api.md), in display order:
the routes of ``common.decisions``, the router's own enumeration."""

from __future__ import annotations

from common.decisions import Route

DECISIONS = tuple(route.value for route in Route)
