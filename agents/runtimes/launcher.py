"""Supervisor of one process-runtime engine: ``python -m agents.runtimes.launcher STATE -- ARGV``.

The agent may die and come back while its engines run on, and a re-adopted engine is no longer
the agent's child, so the agent cannot ``waitpid`` it. This small supervisor (started in its own
session) runs the engine, applies the restart policy the way Docker does, forwards SIGTERM, and
writes every exit code to ``STATE`` (JSON) where any later agent can read it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from common.files import write_json_atomic

MAX_RESTARTS = 5  # the loop stops here so a crashing engine does not spin forever


def main(argv: list[str]) -> int:
    state_path = Path(argv[0])
    policy = argv[1]
    engine_argv = argv[argv.index("--") + 1 :]
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    restarts = 0
    last_code: int | None = None  # survives a restart: whoever looks later sees why
    while True:
        try:
            child = subprocess.Popen(engine_argv)
        except OSError as exc:
            print(f"launcher: cannot execute {engine_argv[0]!r}: {exc}", flush=True)
            write_json_atomic(
                state_path,
                {"child_pid": None, "exit_code": 127, "last_exit_code": 127, "restarts": restarts},
            )
            return 127  # the shell's "command not found"
        write_json_atomic(
            state_path,
            {
                "child_pid": child.pid,
                "exit_code": None,
                "last_exit_code": last_code,
                "restarts": restarts,
            },
        )
        last_code = child.wait()
        write_json_atomic(
            state_path,
            {
                "child_pid": None,
                "exit_code": last_code,
                "last_exit_code": last_code,
                "restarts": restarts,
                "stopped": stopping,
            },
        )
        code = last_code
        again = policy in ("always", "unless-stopped") or (policy == "on-failure" and code != 0)
        if stopping or not again or restarts >= MAX_RESTARTS:
            return code if code >= 0 else 128 - code
        restarts += 1
        time.sleep(min(2.0, 0.1 * 2**restarts))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
