"""Formatting filters for the dashboard templates."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()


@register.filter
def gib(value: Any) -> str:
    """Bytes as GB with one decimal (binary GB, as the agents report memory)."""
    try:
        return f"{float(value) / 1024**3:,.1f} GB"
    except (TypeError, ValueError):
        return "-"


@register.filter
def num(value: Any, digits: int = 1) -> str:
    """A number with ``digits`` decimals, or "-" when there is none."""
    if value is None or isinstance(value, bool):
        return "-"
    try:
        return f"{float(value):,.{int(digits)}f}"
    except (TypeError, ValueError):
        return "-"


@register.filter
def percent_of(used: Any, total: Any) -> float:
    try:
        return round(100.0 * float(used) / float(total), 1) if float(total) else 0.0
    except (TypeError, ValueError):
        return 0.0


@register.filter
def lookup(mapping: Any, key: Any) -> Any:
    return mapping.get(key) if isinstance(mapping, dict) else None
