"""The state table in docs/batches.md is the one the code enforces."""

from __future__ import annotations

import re
from pathlib import Path

from controlplane.batches.choices import (
    BATCH_LIFECYCLE,
    FINAL_STATUSES,
    UNFINISHED_STATUSES,
    WORKER_OWNED_STATUSES,
    BatchStatus,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "batches.md"


def test_the_documented_table_is_the_enforced_one() -> None:
    text = DOC.read_text().split("## States", 1)[1].split("\n## ", 1)[0]
    states = set(BatchStatus.values)
    table: dict[str, set[str]] = {}
    for row in text.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in states:
            table[cells[0]] = {w for w in re.findall(r"[a-z_]+", cells[1]) if w in states}
    assert table == {source: set(targets) for source, targets in BATCH_LIFECYCLE.moves.items()}
    assert set(table) == states


def test_every_status_is_final_or_unfinished_and_a_worker_owns_only_unfinished_ones() -> None:
    assert set(UNFINISHED_STATUSES) | set(FINAL_STATUSES) == set(BatchStatus)
    assert not set(UNFINISHED_STATUSES) & set(FINAL_STATUSES)
    assert all(not BATCH_LIFECYCLE.moves[status] for status in FINAL_STATUSES)
    assert set(WORKER_OWNED_STATUSES) < set(UNFINISHED_STATUSES)
