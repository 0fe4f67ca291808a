"""The embedded broker: kombu's filesystem transport, made safe for many producers and consumers.

kombu's own ``filesystem://`` transport creates a message file and then writes into it, so a
consumer listing the folder in between can claim the empty file and lose the message (it fails
to decode it). It also lists and sorts the whole folder for every message it reads, so a backlog
drains slowly. This transport (``syshaxfs://``) keeps kombu's folder layout and options
(``data_folder_in``/``data_folder_out``, ``control_folder``, ``polling_interval``) and changes
two things:

* **put** writes the message under a dot-name in the same folder and renames it into place.
  A rename is atomic, so a reader sees the whole message or nothing.
* **get** claims a message by renaming it to a name of its own first. Only one consumer can
  win that rename; a loser moves on to the next name. Each folder listing is kept as a backlog
  of that queue's names in order, and reads take from the backlog until it is empty, instead of
  listing again for every message.

Importing this module registers the ``syshaxfs`` scheme with kombu, so every process that uses
the embedded broker (control plane, worker, beat, agents) imports it before connecting.
"""

# kombu's virtual transport is untyped; these are its own method signatures.
# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import os
import time
import uuid
from collections import deque
from pathlib import Path
from queue import Empty
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import filesystem as kombu_fs
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

from common.files import write_bytes_atomic

SCHEME = "syshaxfs"
CLAIM_SUFFIX = ".claimed"


class Channel(kombu_fs.Channel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backlog: dict[str, deque[str]] = {}
        self._owner = uuid.uuid4().hex[:12]

    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # Fixed-width nanoseconds first, so names sort in the order they were put.
        name = f"{time.time_ns():020d}_{uuid.uuid4().hex}.{queue}.msg"
        folder = Path(self.data_folder_out)
        try:
            write_bytes_atomic(folder / name, str_to_bytes(dumps(payload)))
        except OSError as exc:
            raise ChannelError(f"Cannot add message {name!r} to {folder}") from exc

    def _listing(self, queue: Any) -> list[str]:
        """The names of ``queue``'s whole messages (staged and claimed ones are dot-names)."""
        suffix = f".{queue}.msg"
        with os.scandir(self.data_folder_in) as entries:
            return [e.name for e in entries if e.name.endswith(suffix) and e.name[0] != "."]

    def _names(self, queue: str) -> deque[str]:
        backlog = self._backlog.get(queue)
        if not backlog:
            backlog = self._backlog[queue] = deque(sorted(self._listing(queue)))
        return backlog

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        folder = Path(self.data_folder_in)
        backlog = self._names(queue)
        while backlog:
            name = backlog.popleft()
            claimed = folder / f".{name}.{self._owner}{CLAIM_SUFFIX}"
            try:
                os.rename(folder / name, claimed)  # atomic: exactly one consumer wins
            except FileNotFoundError:
                continue  # another consumer took it
            try:
                payload = claimed.read_bytes()
            finally:
                claimed.unlink(missing_ok=True)
            return loads(bytes_to_str(payload))
        raise Empty()

    def _purge(self, queue: Any) -> int:
        self._backlog.pop(queue, None)
        return int(super()._purge(queue))

    def _size(self, queue: Any) -> int:
        return len(self._listing(queue))


class Transport(kombu_fs.Transport):
    Channel = Channel
    driver_type = SCHEME
    driver_name = SCHEME


TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
