"""``syshax up``: the whole system on this machine, on the embedded defaults.

Started in order: database migrations and an admin user, the web app, a Celery worker and
beat. Ctrl-C (or SIGTERM) stops everything and leaves no process behind; running it again
reuses the state under var/.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import httpx

from syshax.supervisor import Supervisor, python_argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="dashboard/API port")
    parser.add_argument(
        "--exit",
        action="store_true",
        help="stop everything once the system is up (and any --benchmark ran)",
    )
    parser.add_argument("--startup-timeout", type=float, default=120.0)


def _ensure_admin(var_dir: Path) -> str | None:
    """Create the admin user on first run. Returns the password only when it was just made."""
    from django.contrib.auth import get_user_model

    User = get_user_model()
    if User.objects.filter(username="admin").exists():
        return None
    password = secrets.token_urlsafe(12)
    User.objects.create_superuser("admin", "admin@localhost", password)
    return password


def _wait_http(url: str, timeout: float, sup: Supervisor) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = sup.first_exited()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited during start-up:\n{sup.tail(dead)}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    from syshax.commands._django import setup

    setup()
    from django.conf import settings
    from django.core.management import call_command

    var_dir = Path(settings.VAR_DIR)
    call_command("migrate", interactive=False, verbosity=0)
    password = _ensure_admin(var_dir)

    sup = Supervisor(var_dir / "logs")
    stopping = False

    def _stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    base = f"http://{args.host}:{args.port}"
    try:
        sup.start("web", python_argv("web", "--bind", f"{args.host}:{args.port}", "--no-migrate"))
        sup.start("worker", python_argv("worker", "--concurrency", "2"))
        sup.start("beat", python_argv("beat"))
        _wait_http(f"{base}/api/v1/health", args.startup_timeout, sup)
        print(f"dashboard  {base}/", flush=True)
        print(f"admin      {base}/admin/", flush=True)
        print(f"API        {base}/api/v1/  (OpenAPI UI: {base}/api/v1/docs/)", flush=True)
        if password:
            print(
                f"admin user: admin / {password}   (shown once; change it in the admin)", flush=True
            )
        print(f"logs       {sup.log_dir}/", flush=True)
        if args.exit:
            return 0
        print("Ctrl-C stops everything.", flush=True)
        while not stopping:
            dead = sup.first_exited()
            if dead is not None:
                print(f"{dead.name} exited:\n{sup.tail(dead)}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except RuntimeError as exc:
        print(f"syshax up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping...", flush=True)
        sup.stop_all()
        print("stopped.", flush=True)
