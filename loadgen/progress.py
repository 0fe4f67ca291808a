"""A live progress bar on stderr, without a dependency.

On a terminal it redraws one line at most ten times a second; elsewhere (a log file, CI) it
prints a single line when the row ends, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from loadgen.records import RequestRecord


class ProgressBar:
    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        width: int = 30,
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.width = width
        self.done = 0
        self.failed = 0
        self.started = time.monotonic()
        self._drawn_at = 0.0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        if not record.ok:
            self.failed += 1
        now = time.monotonic()
        if self.live and (now - self._drawn_at >= 0.1 or self.done == self.total):
            self._drawn_at = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def line(self) -> str:
        filled = self.width * self.done // self.total if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.started
        failed = f"  {self.failed} failed" if self.failed else ""
        return f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s{failed}"

    def close(self) -> None:
        self.stream.write(("\r" if self.live else "") + self.line() + "\n")
        self.stream.flush()
