"""Files other processes read while we write them: atomic replacement and ready files.

Every writer here writes beside the target under a dot-name unique to this process and call,
then renames it over the target, so a reader sees the old file or the whole new one, never
half of it, and two writers of one file (router workers sharing a state cache) never write
into each other's temporary file. A crash between the write and the rename leaves a dot-file
behind and the target untouched.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` in one rename. ``mode`` is the new file's (0o600 for one
    that holds secrets)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode)  # O_CREAT's mode is cut by the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    write_bytes_atomic(path, text.encode(), mode)


def write_json_atomic(path: Path, data: Mapping[str, Any], **dumps: Any) -> None:
    write_text_atomic(path, json.dumps(data, **dumps))


def write_ready_file(path: Path, port: int) -> None:
    """Tell a supervisor which port a child bound (``--port 0 --ready-file F``)."""
    write_text_atomic(path, f"{port}\n")


def read_ready_port(path: Path) -> int | None:
    """The port a child wrote to its ready file, or None while it has not yet.

    Writers use :func:`write_ready_file`, so the file is either absent or complete.
    """
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None
