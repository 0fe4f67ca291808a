"""The progress bar (live on a terminal, one line per row elsewhere) and process priority."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from loadgen.progress import ProgressBar
from loadgen.records import RequestRecord


def test_live_bar_redraws_and_counts_failures() -> None:
    out = io.StringIO()
    bar = ProgressBar(2, "gpu c=1", stream=out, live=True, width=10)
    bar.update(RequestRecord(0, 1, 1, ok=True))
    bar.update(RequestRecord(1, 1, 1, ok=False, error="x"))
    bar.close()
    text = out.getvalue()
    assert text.startswith("\rgpu c=1 [#####.....] 1/2")
    assert "[##########] 2/2" in text and "1 failed" in text
    assert text.endswith("\n")


def test_quiet_bar_prints_one_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(3, "cpu c=2", stream=out, live=False)
    for index in range(3):
        bar.update(RequestRecord(index, 1, 1, ok=True))
    bar.close()
    assert out.getvalue().count("\n") == 1
    assert "3/3" in out.getvalue() and "\r" not in out.getvalue()


@pytest.mark.process
def test_realtime_priority_is_taken_or_explained() -> None:
    # In a child process, so the test run itself keeps its ordinary priority.
    code = (
        "import os; from loadgen.runner import use_realtime_priority as u; "
        "p = u(); print(repr(p), os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK "
        "== os.SCHED_FIFO)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    problem, is_fifo = done.stdout.rsplit(" ", 1)
    if problem == "None":
        assert is_fifo.strip() == "True"
    else:
        assert "SCHED_FIFO" in problem and is_fifo.strip() == "False"
