#!/usr/bin/env python3
"""Is the machine itself stalling? A process that asks to wake every few milliseconds and
writes down each wake-up that came late (testbed/stall_probe.py; scripts/bench/fleet_load.py
starts it beside its load).

    python scripts/bench/stall_probe.py OUT.jsonl [--seconds S] [--tick-ms T] [--late-ms L]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testbed.stall_probe import main

if __name__ == "__main__":
    main()
