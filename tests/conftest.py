"""Suite-wide rules. Area fixtures live in each tests/<area>/conftest.py."""

from __future__ import annotations

import os

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On CI (SYSHAX_FORBID_SKIPS=1) a skipped test fails the run: every service is there."""
    if os.environ.get("SYSHAX_FORBID_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped:
        if reporter:
            reporter.write_line(
                f"SYSHAX_FORBID_SKIPS: {skipped} test(s) skipped although every service is "
                "available on CI; failing the run",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
