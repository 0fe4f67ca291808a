# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from controlplane.settings.env import env_str, find_env_file, load_env_file
from controlplane.webworker import (
    BODY_LIMIT_ENV,
    DEFAULT_READ_TIMEOUT,
    FILE_LIMIT_ENV,
    READ_TIMEOUT_ENV,
    limits_from_env,
)

PROJECT_DIR = Path(__file__).resolve().parents[2]
# Reads each request whole in its event loop before a thread serves it (docs/security.md).
WORKER_CLASS = "controlplane.webworker.BufferedRequestWorker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="127.0.0.1:8000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--read-timeout",
        type=float,
        help=f"seconds a client has to send a whole request, head and body (default: "
        f"${READ_TIMEOUT_ENV}, else {DEFAULT_READ_TIMEOUT:g}); a slower one gets a 408",
    )
    parser.add_argument(
        "--worker-class",
        default=WORKER_CLASS,
        help="gunicorn worker class (default: %(default)s); `gthread` is gunicorn's own, "
        "which lets a slow client hold a thread",
    )
    parser.add_argument("--no-migrate", action="store_true", help="skip `migrate` at start-up")


def worker_environment(read_timeout: float | None) -> None:
    """Put the worker's limits in this process's environment for gunicorn's workers: from the
    env file and ``NAME_FILE`` as the settings read them, checked now so a bad value stops
    the command naming its variable."""
    load_env_file(find_env_file(PROJECT_DIR))
    for name in (READ_TIMEOUT_ENV, BODY_LIMIT_ENV, FILE_LIMIT_ENV):
        value = env_str(name)
        if value is not None:
            os.environ[name] = value
    if read_timeout is not None:
        os.environ[READ_TIMEOUT_ENV] = repr(read_timeout)
    limits_from_env(os.environ)


def run(args: argparse.Namespace) -> int:
    worker_environment(args.read_timeout)
    # _django.setup() and controlplane/wsgi.py both default DJANGO_SETTINGS_MODULE.
    if not args.no_migrate:
        from django.core.management import call_command

        from syshax.commands._django import setup

        setup()
        call_command("migrate", interactive=False, verbosity=0)
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "controlplane.wsgi:application",
        "--bind",
        args.bind,
        "--workers",
        str(args.workers),
        "--threads",
        str(args.threads),
        "--worker-class",
        args.worker_class,
        "--access-logfile",
        "-",
        "--graceful-timeout",
        "10",
    ]
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover - execv does not return
