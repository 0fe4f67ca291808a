"""Typed readers for settings that come from the environment.

Each reader fails loudly with the variable's name, so a bad value stops the process at
start-up instead of surfacing as a confusing error later.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit


class ImproperlyConfiguredEnv(RuntimeError):
    """Raised when an environment variable holds a value that cannot be used."""


def env_str(name: str, default: str | None = None) -> str | None:
    """Return ``name`` from the environment, or from the file named by ``name_FILE``."""
    file_path = os.environ.get(f"{name}_FILE")
    if file_path:
        try:
            return Path(file_path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfiguredEnv(
                f"{name}_FILE={file_path!r} cannot be read: {exc}"
            ) from exc
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = env_str(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfiguredEnv(f"{name}={raw!r} is not a boolean (use true/false, 1/0, yes/no)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfiguredEnv(f"{name}={value} is below the minimum of {minimum}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name}={raw!r} is not a number") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfiguredEnv(f"{name}={value} is below the minimum of {minimum}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = env_str(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def parse_database_url(url: str, *, base_dir: Path, name: str = "DATABASE_URL") -> dict[str, Any]:
    """Turn ``sqlite:///path`` or ``postgres://user:pass@host:port/db`` into a DATABASES entry."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    options = dict(parse_qsl(parts.query))
    if scheme == "sqlite":
        raw_path = unquote(parts.path)
        if raw_path in ("", "/"):
            raise ImproperlyConfiguredEnv(f"{name}={url!r} names no SQLite file")
        # sqlite:///relative.db is relative to the project; sqlite:////abs.db is absolute.
        path = Path(raw_path[1:]) if raw_path.startswith("/") else Path(raw_path)
        if not path.is_absolute():
            path = base_dir / path
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(path),
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    if scheme in {"postgres", "postgresql", "pgsql"}:
        db_name = unquote(parts.path.lstrip("/"))
        if not db_name:
            raise ImproperlyConfiguredEnv(f"{name}={url!r} names no database")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": db_name,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "CONN_MAX_AGE": int(options.pop("conn_max_age", "60")),
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": options,
        }
    raise ImproperlyConfiguredEnv(
        f"{name}={url!r} has an unsupported scheme {scheme!r}; use sqlite:/// or postgres://"
    )


def find_env_file(base_dir: Path) -> Path:
    """The env file this process reads: ``SYSHAX_ENV_FILE``, else ``./syshax.env`` where one
    exists (the directory ``syshax init`` ran in), else the project's own ``syshax.env``."""
    named = env_str("SYSHAX_ENV_FILE")
    if named:
        return Path(named)
    here = Path.cwd() / "syshax.env"
    return here if here.is_file() else base_dir / "syshax.env"


def parse_env_file(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of an env file (written by ``syshax init``); comments and blank
    lines skipped, one layer of quotes taken off a value."""
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ImproperlyConfiguredEnv(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        values[key.strip()] = value.strip().strip('"').strip("'")
    return values


def load_env_file(path: Path) -> None:
    """Put an env file's variables in the environment, without overriding what is there."""
    if not path.is_file():
        return
    for key, value in parse_env_file(path).items():
        os.environ.setdefault(key, value)
