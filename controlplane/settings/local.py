"""Laptop defaults: SQLite and the filesystem broker under var/, a secret generated once."""

from __future__ import annotations

import secrets

from controlplane.settings.base import *  # noqa: F403
from controlplane.settings.base import VAR_DIR
from controlplane.settings.env import env_bool, env_str


def _local_secret_key() -> str:
    configured = env_str("SECRET_KEY")
    if configured:
        return configured
    key_file = VAR_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _local_secret_key()
DEBUG = env_bool("DEBUG", True)
