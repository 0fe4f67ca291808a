"""vLLM's KV cache events on the wire: what ``--kv-events-config`` publishes, and how it is read.

An engine that publishes them sends, on a ZMQ PUB socket, one multipart message per engine
step that changed its prefix cache: ``(topic, seq, payload)``, where ``seq`` is an 8-byte
big-endian counter from 0 and ``payload`` a msgpack ``KVEventBatch``: an array ``[ts, events,
data_parallel_rank]`` whose events are maps tagged by ``"type"`` (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``). The structs below declare the fields in vLLM 0.32's
order (``vllm/distributed/kv_events.py``) with the same msgspec options, so the simulator's
bytes decode as vLLM's do and the router reads either with one decoder. Block hashes are
unsigned 64-bit integers, as vLLM sends them by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec

# vLLM's media names; its block pool reports "GPU" whatever the device, the CPU backend's too.
MEDIUM_GPU = "GPU"
HASH_MASK = (1 << 64) - 1
SEQ_BYTES = 8
# The replay socket's end-of-replay marker (seq -1, signed).
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def batch_decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    """A decoder that checks every field's type (a wrong one raises ``msgspec.DecodeError``)."""
    return msgspec.msgpack.Decoder(KVEventBatch)


def external_hash(block_hash: int) -> int:
    """A block hash as vLLM sends it: an unsigned 64-bit integer."""
    return block_hash & HASH_MASK


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``): the same keys and
    defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str,),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config`` JSON; a ValueError naming the key that is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(sorted(known))})")
        kinds = _TYPES[key]
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise ValueError(f"{key!r} must be {' or '.join(k.__name__ for k in kinds)}")
    config = KVEventsConfig(**data)
    publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"publisher must be 'zmq' or 'null', got {publisher!r}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, key) < 1:
            raise ValueError(f"{key!r} must be >= 1")
    return KVEventsConfig(**{**data, "publisher": publisher})


def subscriber_url(endpoint: str, engine_url: str) -> str | None:
    """Where a router connects to hear an engine whose publisher binds ``endpoint``: a
    wildcard host (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) is the engine's own host, taken
    from its HTTP URL; None for an endpoint no other host can reach (ipc, inproc, port 0)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit() or port == "0":
        return None
    if host in ("*", "0.0.0.0", "[::]", "::"):
        authority = engine_url.split("://", 1)[-1].split("/", 1)[0]
        host = authority.rpartition(":")[0] or authority
    return f"tcp://{host}:{port}"


def engine_kv_events_url(args: Sequence[str], engine_url: str) -> str | None:
    """Where a router hears the engine started with command line ``args`` (its
    ``--kv-events-config``, the last one given) and serving at ``engine_url``; None where it
    publishes none a router can reach, or the flag's JSON is not valid."""
    text = None
    for i, arg in enumerate(args):
        if arg == "--kv-events-config" and i + 1 < len(args):
            text = args[i + 1]
        elif arg.startswith("--kv-events-config="):
            text = arg.partition("=")[2]
    if text is None or not engine_url:
        return None
    try:
        config = parse_kv_events_config(text)
    except ValueError:
        return None  # the engine refuses to start with it: nothing to hear
    return subscriber_url(config.endpoint, engine_url) if config.publishes else None
