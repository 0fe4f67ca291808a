"""testbed/stall_probe.py: the machine-stall probe the fleet benchmark runs beside its load
(scripts/bench/stall_probe.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed import stall_probe

pytestmark = pytest.mark.process  # the probe as a child process

PROBE = [sys.executable, "-m", "testbed.stall_probe"]


def test_every_late_wake_up_is_written_with_its_time(tmp_path: Path) -> None:
    out = tmp_path / "stalls.jsonl"
    # A threshold of a microsecond: every wake-up is that late, so each one is written.
    args = [str(out), "--seconds", "0.3", "--tick-ms", "5", "--late-ms", "0.001"]
    subprocess.run([*PROBE, *args], check=True, timeout=30)
    scheduler, stalls = stall_probe.read(str(out))
    # Root gets the real-time scheduler (CI runs as root); anyone else is told why not.
    assert scheduler == "SCHED_FIFO 50" or scheduler.startswith("normal priority")
    assert 10 <= len(stalls) <= 60
    assert all(ms > 0 for _, ms in stalls)
    assert [at for at, _ in stalls] == sorted(at for at, _ in stalls)


def test_a_wake_up_on_time_is_not_written(tmp_path: Path) -> None:
    out = tmp_path / "stalls.jsonl"
    args = [str(out), "--seconds", "0.2", "--tick-ms", "5", "--late-ms", "10000"]
    subprocess.run([*PROBE, *args], check=True, timeout=30)
    assert stall_probe.read(str(out))[1] == []


def test_bad_arguments_name_the_limit(tmp_path: Path) -> None:
    args = [str(tmp_path / "x"), "--tick-ms", "0"]
    done = subprocess.run([*PROBE, *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--tick-ms must be between 0.1 and 1000" in done.stderr
