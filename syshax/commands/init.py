"""``syshax init``: write a local env file holding the embedded defaults, ready to edit."""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

TEMPLATE = """\
# syshax local configuration, written by `syshax init`. The control plane reads this file
# (or the one SYSHAX_ENV_FILE names) at start-up; real environment variables win over it.
# Every variable is described in docs/configuration.md.

SECRET_KEY={secret}
DEBUG=true
# SQLite under var/ by default; for PostgreSQL: postgres://user:password@127.0.0.1:5432/syshax
DATABASE_URL={database_url}
# Leave unset to use the filesystem broker under var/celery; set for Redis:
{redis_line}
HEARTBEAT_INTERVAL_SECONDS=5
HEARTBEAT_TOLERANCE=3
# Where `syshax config` and agents reach the control plane
SYSHAX_URL=http://127.0.0.1:8000
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", default="syshax.env", help="file to write (default: syshax.env)")
    parser.add_argument("--database-url", default="sqlite:///var/controlplane.sqlite3")
    parser.add_argument("--redis-url", default="", help="redis://127.0.0.1:6379/0 to use Redis")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.exists() and not args.force:
        print(f"{path} exists; keeping it (use --force to overwrite)")
        return 0
    redis_line = (
        f"REDIS_URL={args.redis_url}" if args.redis_url else "# REDIS_URL=redis://127.0.0.1:6379/0"
    )
    path.write_text(
        TEMPLATE.format(
            secret=secrets.token_urlsafe(50),
            database_url=args.database_url,
            redis_line=redis_line,
        )
    )
    path.chmod(0o600)
    print(f"wrote {path}")
    return 0
