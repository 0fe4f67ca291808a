from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs=argparse.REMAINDER, help="manage.py arguments")


def run(args: argparse.Namespace) -> int:
    import os

    from django.core.management import execute_from_command_line

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    execute_from_command_line(["syshax manage", *args.args])
    return 0
