"""Stand-ins for the few vLLM modules the KV connector imports, on a machine where vLLM is not
installed (a GPU host that has only torch). The benchmark harness installs them so the
connector file loads there exactly as it is; where vLLM is importable it uses vLLM's own
modules and installs nothing. The connector never stands anything in itself.

What stands in: ``KVConnectorBase_V1`` (its metadata binding and the cache-manager hook the
connector uses), ``KVConnectorMetadata``, ``KVConnectorRole``, ``KVConnectorTransferResults``,
``RequestStatus``, ``init_logger`` and the forward context. Nothing here computes.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    pass


@dataclass
class KVConnectorTransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class KVConnectorBase_V1:  # vLLM's name
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._kv_cache_manager: Any = None
        self._connector_metadata: Any = None
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> Any:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()


_forward_context: Any = None


def get_forward_context() -> Any:
    assert _forward_context is not None, "no forward context is set"
    return _forward_context


@contextmanager
def override_forward_context(context: Any) -> Iterator[None]:
    global _forward_context
    before, _forward_context = _forward_context, context
    try:
        yield
    finally:
        _forward_context = before


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


_installed = False


def active() -> bool:
    """Whether the stand-ins are in use in this process."""
    return _installed


def install(force: bool = False) -> bool:
    """Put the stand-in modules into ``sys.modules`` unless vLLM is installed (``force``: even
    then, to try here what a host without vLLM runs); returns whether they are in use."""
    global _installed
    if _installed or "vllm" in sys.modules or (vllm_installed() and not force):
        return _installed
    contents: dict[str, dict[str, Any]] = {
        "vllm": {},
        "vllm.logger": {"init_logger": init_logger},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorBase_V1": KVConnectorBase_V1,
            "KVConnectorMetadata": KVConnectorMetadata,
            "KVConnectorRole": KVConnectorRole,
            "KVConnectorTransferResults": KVConnectorTransferResults,
        },
        "vllm.v1": {},
        "vllm.v1.request": {"RequestStatus": RequestStatus},
        "vllm.forward_context": {
            "get_forward_context": get_forward_context,
            "override_forward_context": override_forward_context,
        },
    }
    for name, attrs in contents.items():
        module = types.ModuleType(name, "stand-in (kvbench.standin): vLLM is not installed")
        module.__dict__.update(attrs)
        module.__path__ = []  # each may be a package, so its children import
        sys.modules[name] = module
    _installed = True
    return True
