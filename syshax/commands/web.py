from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="127.0.0.1:8000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--no-migrate", action="store_true", help="skip `migrate` at start-up")


def run(args: argparse.Namespace) -> int:
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
        "--access-logfile",
        "-",
        "--graceful-timeout",
        "10",
    ]
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover - execv does not return
