"""State tables that the code enforces: one ``Lifecycle`` per stateful field.

The tables are written once, in each app's ``choices.py``, and docs/lifecycles.md shows them
(a test compares the two). A model's ``transition`` checks a move against its table before
it sets anything; a move the table does not allow is a bug or a race, and raises
``TransitionError`` (a ``FieldError``, so an API answers 400 naming the field) instead of
silently writing a state the rest of the code does not expect.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from common.errors import FieldError


class TransitionError(FieldError):
    pass


class Lifecycle:
    def __init__(self, field: str, moves: Mapping[str, Iterable[str]]) -> None:
        self.field = field
        self.moves = {source: frozenset(targets) for source, targets in moves.items()}
        unknown = set().union(*self.moves.values()) - set(self.moves)
        if unknown:
            raise ValueError(f"{field}: targets without a row of their own: {sorted(unknown)}")

    def allows(self, current: str, to: str) -> bool:
        return to in self.moves.get(current, frozenset())

    def check(self, current: str, to: str) -> None:
        if not self.allows(current, to):
            allowed = ", ".join(sorted(self.moves.get(current, ()))) or "nothing"
            raise TransitionError(
                self.field, f"cannot go from {current} to {to}; from {current} only to {allowed}"
            )

    def sources(self, to: str) -> frozenset[str]:
        """The states ``to`` may be reached from (for compare-and-set updates)."""
        return frozenset(s for s, targets in self.moves.items() if to in targets)
