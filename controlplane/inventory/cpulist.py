"""Linux CPU-list strings ("0-3,8,10-11") to sets and back. Pure functions."""

from __future__ import annotations

from collections.abc import Iterable


class CpuListError(ValueError):
    pass


def parse_cpu_list(text: str) -> list[int]:
    """Parse ``"0-3,8"`` into ``[0, 1, 2, 3, 8]``. Raises ``CpuListError`` on bad syntax."""
    cpus: set[int] = set()
    text = (text or "").strip()
    if not text:
        return []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise CpuListError(f"empty item in CPU list {text!r}")
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise CpuListError(f"{part!r} is not a CPU number or range") from None
        if lo < 0 or hi < lo:
            raise CpuListError(f"{part!r} is not a valid CPU range")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Format ``[0, 1, 2, 3, 8]`` as ``"0-3,8"``."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)
