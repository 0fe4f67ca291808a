# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--queues",
        default="controlplane",
        help="comma-separated queues: controlplane (deploys, housekeeping) or benchmarks",
    )
    parser.add_argument("--loglevel", default="INFO")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    from controlplane.celery import app

    app.worker_main(
        [
            "worker",
            "-Q",
            args.queues,
            "-c",
            str(args.concurrency),
            "--loglevel",
            args.loglevel,
            "-n",
            f"controlplane@{os.uname().nodename}.{os.getpid()}",
        ]
    )
    return 0
