"""Suite-wide rules. Area fixtures live in each tests/<area>/conftest.py.

Tiers (CONTRIBUTING.md). A test that starts a child process carries a marker saying what it
starts; every other test is in the fast tier, the one `make check` runs in parallel:

- ``process``: a server, agent, simulator, router, gunicorn, Celery worker, throwaway
  PostgreSQL/Redis or a command-line run, i.e. any child process (``git`` and ``ruff`` too);
- ``engine``: real vLLM engines (the real-engine tier, tests/realengine, and its simulator twins);
- ``container``: Podman or Docker containers;
- ``netns``: network namespaces (root and iproute2);
- ``browser``: Chromium through Playwright;
- ``slow``: starts nothing but runs for more than about ten seconds.

A module says so with ``pytestmark``, or a fixture that starts processes marks the tests that use
it (``FIXTURE_MARKS``); whole directories of one tier are marked by path (``MODULE_MARKS``).
The guard below fails a test that starts a child process without one of the first five markers.
"""

from __future__ import annotations

import _posixsubprocess
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Markers of tests that start something; the fast tier is every test with none of these.
STARTS = ("process", "engine", "container", "netns", "browser")

# Fixtures that start processes, by the directory whose tests see them: a test using one gets
# the marker.
FIXTURE_MARKS = {
    "tests/loadgen/": {"fast_sim": "process", "realtime_sim": "process", "pd_router": "process"},
    "tests/agents/": {"podman_service": "container", "docker_runtime": "container"},
    "tests/cluster/": {"network": "netns", "fleet": "netns"},
    "tests/realengine/": {"engines": "engine", "router": "engine"},
    "tests/router/": {
        "engines": "process",
        "router_factory": "process",
        "slow_cpu": "process",
        "own_redis": "process",
    },
    "tests/sim/": {
        "sim_factory": "process",
        "gpu_sim": "process",
        "cpu_sim": "process",
        "engine": "process",  # test_api.py
        "pair": "process",  # test_connector.py, test_handoff.py
        "caching_pair": "process",  # test_connector.py
    },
    "tests/controlplane/": {"simulated_gpu": "process", "web": "process"},
}
# Modules marked from here, by path from the repository root: whole directories end in "/".
MODULE_MARKS = {
    "tests/realengine/": "engine",
    "tests/deploy/": "container",
    "tests/cluster/": "netns",
    "tests/chaos/": "process",
    "tests/system/": "process",
    "tests/broker/": "process",
}


def _path_marks(relpath: str) -> list[str]:
    return [
        mark
        for prefix, mark in MODULE_MARKS.items()
        if relpath == prefix or (prefix.endswith("/") and relpath.startswith(prefix))
    ]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks by path and by fixture, before ``-m`` selects (tryfirst)."""
    for item in items:
        relpath = Path(str(item.path)).resolve().relative_to(ROOT).as_posix()
        wanted = set(_path_marks(relpath))
        fixtures = set(getattr(item, "fixturenames", ()))
        for prefix, marks in FIXTURE_MARKS.items():
            if relpath.startswith(prefix):
                wanted.update(mark for name, mark in marks.items() if name in fixtures)
        for name in sorted(wanted):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)


# --- the guard --------------------------------------------------------------------------------


def _finding_a_library() -> bool:
    """Whether ``ctypes.util.find_library`` is the caller: it asks ldconfig or gcc where a
    shared library is (Django's GIS support probing for GDAL on the first API schema build), a
    lookup rather than something the test starts."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "find_library" and "ctypes" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class _Guard:
    """While an unmarked test runs (setup, call, teardown), starting a child process raises and is
    recorded, so a start in another thread fails the test too."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.caught: list[str] = []
        self.saved: dict[tuple[Any, str], Any] = {}

    def refuse(self, what: str) -> None:
        assert self.item is not None
        message = (
            f"{self.item.nodeid} started a child process ({what}) but carries none of the "
            f"markers {', '.join(STARTS)}: add `pytestmark = pytest.mark.process` to its module "
            "(or the marker for what it starts, or the test's fixture to FIXTURE_MARKS in "
            "tests/conftest.py; CONTRIBUTING.md, 'Tiers and markers')"
        )
        self.caught.append(message)
        raise pytest.fail.Exception(message, pytrace=False)

    def _wrap(self, owner: Any, name: str, describe: Callable[..., str]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        self.saved[(owner, name)] = original
        guard = self

        def refused(*args: Any, **kwargs: Any) -> Any:
            if _finding_a_library():
                return original(*args, **kwargs)
            guard.refuse(describe(*args, **kwargs))

        setattr(owner, name, refused)

    def install(self, item: pytest.Item) -> None:
        self.item, self.caught = item, []

        def popen_argv(_self: Any, args: Any, *_a: Any, **_k: Any) -> str:
            argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
            return " ".join(str(a) for a in argv[:4])

        self._wrap(subprocess.Popen, "__init__", popen_argv)  # run, check_output, asyncio
        self._wrap(_posixsubprocess, "fork_exec", lambda *a, **k: "multiprocessing spawn")
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            self._wrap(os, name, lambda *a, _n=name, **k: f"os.{_n}")

    def uninstall(self) -> None:
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)
        self.saved.clear()


_GUARD = _Guard()


def _guarded(item: pytest.Item) -> Generator[None, Any, Any]:
    if any(item.get_closest_marker(name) for name in STARTS):
        return (yield)
    _GUARD.install(item)
    try:
        result = yield
    finally:
        _GUARD.uninstall()
    if _GUARD.caught:
        raise pytest.fail.Exception(_GUARD.caught[0], pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


# --- parallel workers (pytest-xdist) ----------------------------------------------------------


def _redis_db_url(url: str, offset: int) -> str:
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    if base + offset > 15:
        raise pytest.UsageError(
            f"REDIS_URL {url}: worker {offset} would need database {base + offset}; "
            "Redis has 0-15, so start from a lower database number"
        )
    return urlunsplit(parts._replace(path=f"/{base + offset}"))


# Optional: the real-engine tier runs tests/kvconnector in vLLM's virtualenv, without xdist.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: list[Any]) -> None:
    """Each worker its own var dir (embedded broker folder, SQLite file, secret key) and its own
    Redis database, set in its environment before Django reads its settings. The test database
    gets the worker's suffix (``_gw0``...) from pytest-django."""
    var_dir = os.environ.get("SYSHAX_VAR_DIR") or str(ROOT / "var")
    redis_url = os.environ.get("REDIS_URL", "")
    for index, spec in enumerate(specs):
        worker = spec.id or f"gw{index}"
        worker_var = Path(var_dir) / worker
        worker_var.mkdir(parents=True, exist_ok=True)
        spec.env["SYSHAX_VAR_DIR"] = str(worker_var)
        if redis_url:
            spec.env["REDIS_URL"] = _redis_db_url(redis_url, index)


def _reused_sqlite(config: pytest.Config) -> Path | None:
    """The test database file ``--reuse-db`` keeps on SQLite, or None."""
    if not config.getvalue("reuse_db"):
        return None
    from django.conf import settings

    if not settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return Path(settings.VAR_DIR) / f"test-controlplane-reused-{worker}.sqlite3"


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    request: pytest.FixtureRequest, django_db_modify_db_settings_parallel_suffix: None
) -> None:
    """With ``--reuse-db`` (`make check`) the SQLite test database keeps one name between runs
    (settings name it after the process id, so concurrent runs never share a file), and each run
    starts from the copy taken just after the last run's migrations: the rows data migrations
    seed are back, which the transactional tests' flushes removed."""
    reused = _reused_sqlite(request.config)
    if reused is None:
        return
    from django.conf import settings

    settings.DATABASES["default"].setdefault("TEST", {})["NAME"] = str(reused)
    template = reused.with_suffix(".migrated")
    if template.exists():
        shutil.copyfile(template, reused)
    else:  # a file without its copy may have been flushed: migrate afresh
        reused.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def django_db_setup(
    request: pytest.FixtureRequest, django_db_setup: None, django_db_blocker: Any
) -> None:
    """pytest-django's, then with ``--reuse-db`` on SQLite the migrated database copied aside
    for the next run (new migrations have been applied to it by now)."""
    reused = _reused_sqlite(request.config)
    if reused is None:
        return
    template = reused.with_suffix(".migrated")
    partial = reused.with_suffix(".partial")
    with django_db_blocker.unblock(), sqlite3.connect(reused) as source:
        with sqlite3.connect(partial) as target:
            source.backup(target)
        target.close()
    source.close()
    partial.replace(template)


# --- CI -----------------------------------------------------------------------------------------


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On CI (SYSHAX_FORBID_SKIPS=1) a skipped test fails the run: every service is there.
    Under xdist the controller counts its workers' reports."""
    if os.environ.get("SYSHAX_FORBID_SKIPS") != "1" or hasattr(session.config, "workerinput"):
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
