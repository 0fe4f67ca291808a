"""``syshax init``: prepare a directory for ``syshax config`` and ``syshax run``.

Like sysHAX's ``cli.py init``: it writes ``syshax.env`` (the control plane's embedded defaults
and the router's engine URLs and port, sysHAX's 7001 / 7002 / 7010), migrates the control
plane's database, creates the default scheduling policy and exports it to
``<var>/policy.json`` for the router. Run again, it keeps the file and only brings the
database up to date, so it is always safe.
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from common.files import write_text_atomic
from syshax.commands.localconfig import LOCAL_KEYS, LocalConfigError, resolve

TEMPLATE = """\
# syshax local configuration, written by `syshax init`. The control plane, `syshax config` and
# `syshax run` read this file (or the one SYSHAX_ENV_FILE names) at start-up; real environment
# variables win over it. Every variable is described in docs/configuration.md.

SECRET_KEY={secret}
DEBUG=true
# State: the SQLite database, broker folders, logs and the router's policy.json
SYSHAX_VAR_DIR={var_dir}
{database_line}
# Leave unset to use the filesystem broker under the state directory; set for Redis:
{redis_line}
HEARTBEAT_INTERVAL_SECONDS=5
HEARTBEAT_TOLERANCE=3

# `syshax run`: the router and the engines it routes to (`syshax config gpu_url URL` etc.)
{router_lines}
# With both set, `syshax run` starts a managed router that takes its deployments and policy
# from that control plane instead:
# SYSHAX_CONTROL_PLANE_URL=http://127.0.0.1:8000
# SYSHAX_ROUTER_TOKEN=sxr_...
# Require an API key from the router's clients:
# SYSHAX_ROUTER_API_KEY=
"""
OPTIONAL_VARS = {"SYSHAX_CONTROL_PLANE_URL", "SYSHAX_ROUTER_TOKEN", "SYSHAX_ROUTER_API_KEY"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", default="syshax.env", help="file to write (default: syshax.env)")
    parser.add_argument(
        "--database-url",
        default="",
        help="postgres://user:password@host:5432/name (default: SQLite in the state directory)",
    )
    parser.add_argument("--redis-url", default="", help="redis://127.0.0.1:6379/0 to use Redis")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def render(args: argparse.Namespace, var_dir: Path) -> str:
    database_line = (
        f"DATABASE_URL={args.database_url}"
        if args.database_url
        else "# DATABASE_URL=postgres://user:password@127.0.0.1:5432/syshax"
    )
    redis_line = (
        f"REDIS_URL={args.redis_url}" if args.redis_url else "# REDIS_URL=redis://127.0.0.1:6379/0"
    )
    router_lines = "\n".join(
        f"{key.var}={key.default}" for key in LOCAL_KEYS if key.var not in OPTIONAL_VARS
    )
    return TEMPLATE.format(
        secret=secrets.token_urlsafe(50),
        var_dir=var_dir,
        database_line=database_line,
        redis_line=redis_line,
        router_lines=router_lines,
    )


def run(args: argparse.Namespace) -> int:
    path = Path(args.path).resolve()
    if path.exists() and not args.force:
        print(f"{path} exists; keeping it (use --force to overwrite)")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, render(args, path.parent / "var"), 0o600)  # it holds a secret
        print(f"wrote {path}")
    try:
        resolve(path)
    except LocalConfigError as exc:
        print(f"syshax init: {exc}", file=sys.stderr)
        return 2
    # This process reads the file just written, whatever the directory.
    os.environ["SYSHAX_ENV_FILE"] = str(path)
    from django.core.management import call_command

    from syshax.commands._django import setup
    from syshax.commands.localconfig import export_policy

    setup()
    call_command("migrate", interactive=False, verbosity=0)
    policy_file = export_policy()
    print(f"database ready, default policy exported to {policy_file}")
    if path != (Path.cwd() / "syshax.env").resolve():
        print(f"other commands find this file with: export SYSHAX_ENV_FILE={path}")
    print("next: syshax config KNOB VALUE (e.g. auto_pd_offload true), then syshax run")
    return 0
