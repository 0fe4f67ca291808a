from __future__ import annotations

import contextlib
import os
from typing import Any

from django.apps import AppConfig
from django.db.backends.signals import connection_created

from controlplane.core import tracing


def _private_sqlite_files(sender: Any, connection: Any, **kwargs: Any) -> None:
    """The SQLite database holds people's API tokens and profiles' secrets: owner-only, like the
    directory it lives in (settings: SYSHAX_VAR_DIR is made 0700)."""
    if connection.vendor != "sqlite":
        return
    name = str(connection.settings_dict.get("NAME") or "")
    if not name or name.startswith(":memory:") or "mode=memory" in name:
        return
    for path in (name, f"{name}-wal", f"{name}-shm"):
        # Not there yet (WAL files appear on the first write), or not ours: nothing to do.
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)


class CoreConfig(AppConfig):
    name = "controlplane.core"
    label = "core"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        connection_created.connect(_private_sqlite_files, dispatch_uid="syshax-private-sqlite")
        # Before any request handler loads its middleware, which the Django instrumentation
        # adds to; nothing when no collector is named (docs/tracing.md).
        tracing.start()
