"""Run real control-plane processes (worker, web) against the test database."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from django.conf import settings
from django.db import connection

from common.supervisor import free_port, python_argv, wait_until


def test_database_url() -> str:
    """The URL of the database pytest-django created, for processes the test starts."""
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{connection.settings_dict['NAME']}"
    user = db.get("USER") or "postgres"
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or "5432"
    return f"postgres://{user}{password}@{host}:{port}/{connection.settings_dict['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "DATABASE_URL": test_database_url(), "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


@contextmanager
def running(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a process in its own group for the duration of the block; kill the group after."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            start_new_session=True,
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                with suppress(subprocess.TimeoutExpired):
                    process.wait(15)
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


# The syshax argv prefix, free_port and wait_until live in common.supervisor; these names
# stay importable from here for the tests that use them.
syshax = python_argv
__all__ = ["child_env", "free_port", "running", "syshax", "test_database_url", "wait_until"]
