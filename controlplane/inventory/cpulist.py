"""Linux CPU-list strings ("0-3,8,10-11"), as the control plane uses them.

The parser and formatter are the agents' (one implementation for both sides); here an empty
list is allowed (a node that has not reported yet) and errors are plain ``ValueError``s.
"""

from __future__ import annotations

from common.affinity import AffinityError
from common.affinity import format_cpu_list as format_cpu_list
from common.affinity import parse_cpu_list as _parse


class CpuListError(ValueError):
    pass


def parse_cpu_list(text: str) -> list[int]:
    """Parse ``"0-3,8"`` into ``[0, 1, 2, 3, 8]``; ``""`` gives ``[]``."""
    if not (text or "").strip():
        return []
    try:
        return list(_parse(text))
    except AffinityError as exc:
        raise CpuListError(f"{exc.message} in CPU list {text!r}") from None
