"""The simulator's side of the SyshaxShmConnector contract (kvconnector/).

Same wire contract as the real connector: a prefill with ``kv_transfer_params:
{"do_remote_decode": true}`` publishes its prompt's KV as
``<shm_dir>/syshax-kv-<transfer id>-r<rank>-<lease expiry>`` and answers the transfer's
``kv_transfer_params``; a request whose ``kv_transfer_params`` carry a ``transfer_id`` claims
that segment (rename to ``.claimed``), loads ``num_tokens`` tokens and unlinks it. The checks
and their order are the connector's: transfer id, producer = configured peer, IPC namespace,
model geometry, the fields, tensor parallelism, prompt longer than the transfer, lease,
presence. A failed check is not an HTTP error: the caller logs it and recomputes the prompt.

The payload is synthetic: the file is sized like the real KV (sparse) behind the real
connector's header format (magic, version, JSON header).

As in the connector, a prefill answers as soon as its step ends and publishes its segment
when its copy has landed (the export time later): a ``.tmp`` segment stands for the copy
under way, and a decode that arrives first waits for the segment, bounded by the lease
(:meth:`Connector.wait_published`). Published segments count against the producer's arena
(``arena_mib``); a prefill that does not fit answers ``syshax_kv_fallback`` and publishes
nothing. The simulator counts slabs where the connector keeps runs of consecutive slabs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.presets import ModelPreset
from kvconnector import syshax_kv_shm as shm

CONNECTOR_NAME = "SyshaxShmConnector"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
MAGIC = b"SYSHAXKV"
FORMAT_VERSION = 1
HEADER_SPACE = 1 << 16
# The connector's own names and checks (syshax_kv_shm.py is standard library only).
SEGMENT_RE = shm.SEGMENT_RE
SegmentError = shm.SegmentError
ipc_namespace = shm.ipc_namespace
segment_name = shm.segment_name
DEFAULT_ARENA_MIB = 1024.0
DEFAULT_SLAB_KIB = 2048


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``--kv-transfer-config`` says; None where it says nothing."""

    kv_role: str
    engine_id: str | None = None
    peer_engine_id: str | None = None
    shm_dir: Path | None = None
    lease_seconds: float | None = None
    arena_mib: float = DEFAULT_ARENA_MIB
    slab_kib: int = DEFAULT_SLAB_KIB


def parse_kv_transfer_config(text: str) -> ConnectorConfig:
    """``--kv-transfer-config`` JSON; ValueError with the reason when it is unusable here."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object")
    connector = raw.get("kv_connector")
    if connector != CONNECTOR_NAME:
        raise ValueError(
            f"kv_connector {connector!r}: the simulator implements only {CONNECTOR_NAME}"
        )
    role = raw.get("kv_role") or "kv_both"
    if role not in KV_ROLES:
        raise ValueError(f"kv_role {role!r} must be one of {', '.join(KV_ROLES)}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be an object")
    lease = extra.get("lease_seconds")
    try:
        lease_seconds = None if lease is None else float(lease)
    except (TypeError, ValueError):
        raise ValueError(f"lease_seconds {lease!r} is not a number") from None
    if lease_seconds is not None and lease_seconds <= 0:
        raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
    arena = extra.get("arena_mib", DEFAULT_ARENA_MIB)
    slab = extra.get("slab_kib", DEFAULT_SLAB_KIB)
    for key, value, high in (("arena_mib", arena, 1 << 20), ("slab_kib", slab, 1 << 20)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value) or not 0 <= value <= high:
            raise ValueError(f"{key} must be in [0, {high}]: {value}")
    if slab < 4 or int(slab) % 4:
        raise ValueError(f"slab_kib must be a multiple of 4 of at least 4: {slab}")
    engine_id = extra.get("engine_id") or raw.get("engine_id")
    return ConnectorConfig(
        kv_role=role,
        engine_id=str(engine_id) if engine_id else None,
        peer_engine_id=str(extra["peer_engine_id"]) if extra.get("peer_engine_id") else None,
        shm_dir=Path(str(extra["shm_dir"])) if extra.get("shm_dir") else None,
        lease_seconds=lease_seconds,
        arena_mib=float(arena),
        slab_kib=int(slab),
    )


def is_connector_segment(name: str) -> bool:
    return SEGMENT_RE.match(name) is not None


class Connector:
    """One engine's connector: publishes its prefills' KV and loads its peer's."""

    def __init__(
        self,
        *,
        engine_id: str,
        peer_engine_id: str | None,
        shm_dir: Path,
        lease_seconds: float,
        model: ModelPreset,
        tensor_parallel_size: int,
        arena_mib: float = DEFAULT_ARENA_MIB,
        slab_kib: int = DEFAULT_SLAB_KIB,
    ) -> None:
        self.engine_id = engine_id
        self.peer = peer_engine_id
        self.shm_dir = shm_dir
        self.lease_seconds = lease_seconds
        self.model = model
        self.tp = tensor_parallel_size
        self.ipc_ns = ipc_namespace()
        self.slab_bytes = slab_kib * 1024
        self.slabs = int(arena_mib * 2**20) // self.slab_bytes
        # Published or pending transfers of this engine: tid -> (slabs, lease expiry).
        self._held: dict[str, tuple[int, int]] = {}
        # What both engines must share for a segment to be usable (the real connector's keys).
        self.geometry: dict[str, Any] = {
            "layers": model.layers,
            "kv_heads": model.kv_heads,
            "head_size": model.head_dim,
            "kv_dtype": "auto",
            "model_dtype": "torch.bfloat16",
        }

    def describe(self) -> dict[str, Any]:
        return {
            "connector": CONNECTOR_NAME,
            "engine_id": self.engine_id,
            "peer_engine_id": self.peer,
            "shm_dir": str(self.shm_dir),
            "lease_seconds": self.lease_seconds,
            "ipc_namespace": self.ipc_ns,
            "geometry": self.geometry,
        }

    # -- producer ------------------------------------------------------------------------

    def publish(self, num_tokens: int) -> dict[str, Any]:
        """Start the copy of a prefill's ``num_tokens`` prompt tokens: its segments (one per
        rank) pending, to be published by :meth:`land`; returns the transfer's
        ``kv_transfer_params``, or ``syshax_kv_fallback`` when the arena cannot hold it."""
        per_rank = self.model.kv_bytes_per_token * num_tokens // self.tp
        need = max(1, -(-per_rank // self.slab_bytes))
        free = self._free_slabs()
        if need > free:
            why = (
                "this engine has no KV arena (arena_mib 0)"
                if not self.slabs
                else f"arena full: the transfer needs {shm.size(need * self.slab_bytes)}, "
                f"{shm.size(free * self.slab_bytes)} free of "
                f"{shm.size(self.slabs * self.slab_bytes)}"
            )
            return {"syshax_kv_fallback": why}
        tid = uuid.uuid4().hex
        expires_at = math.ceil(time.time() + self.lease_seconds)
        for rank in range(self.tp):
            self._write(tid, rank, num_tokens, expires_at)
        self._held[tid] = (need, expires_at)
        return {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "segment": segment_name(tid, 0, expires_at),
            "num_tokens": num_tokens,
            "ranks": self.tp,
            "lease_expires_at": expires_at,
            "producer_engine_id": self.engine_id,
            "ipc_namespace": self.ipc_ns,
            "geometry": self.geometry,
        }

    def _write(self, tid: str, rank: int, num_tokens: int, expires_at: int) -> None:
        name = segment_name(tid, rank, expires_at)
        header = json.dumps(
            {
                "transfer_id": tid,
                "rank": rank,
                "producer_engine_id": self.engine_id,
                "ipc_namespace": self.ipc_ns,
                "num_tokens": num_tokens,
                "lease_expires_at": expires_at,
                "format": "synthetic",
                "model": self.model.name,
            }
        ).encode()
        tmp = self.shm_dir / f"{name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Sparse: sized like this rank's share of the real KV, costing no memory.
            per_rank = self.model.kv_bytes_per_token * num_tokens // self.tp
            os.ftruncate(fd, HEADER_SPACE + per_rank)
            lengths = FORMAT_VERSION.to_bytes(4, "little") + len(header).to_bytes(4, "little")
            os.pwrite(fd, MAGIC + lengths + header, 0)
        finally:
            os.close(fd)

    def land(self, params: dict[str, Any]) -> None:
        """The copy has landed: publish its segments (a pending one the reaper removed, its
        lease over, stays gone)."""
        tid, expires_at = params["transfer_id"], params["lease_expires_at"]
        for rank in range(self.tp):
            name = segment_name(tid, rank, expires_at)
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.shm_dir / f"{name}.tmp", self.shm_dir / name)

    def _free_slabs(self) -> int:
        """Slabs not held by a transfer whose files still exist (loaded or reaped ones
        come back)."""
        for tid, (_, expires_at) in list(self._held.items()):
            names = [segment_name(tid, r, expires_at) for r in range(self.tp)]
            suffixes = ("", ".tmp", ".claimed")
            if not any((self.shm_dir / (n + x)).exists() for n in names for x in suffixes):
                del self._held[tid]
        return self.slabs - sum(slabs for slabs, _ in self._held.values())

    # -- consumer ------------------------------------------------------------------------

    async def wait_published(self, params: dict[str, Any], prompt_tokens: int) -> None:
        """Wait while the transfer's copy is under way (its segment pending), bounded by its
        lease; what :meth:`load` then finds decides the outcome (a transfer that fails its
        checks is not waited for)."""
        try:
            tid, _, _, expires_at = self._check(params, prompt_tokens)
        except SegmentError:
            return
        pending = self.shm_dir / (segment_name(tid, 0, expires_at) + ".tmp")
        # Another process publishes it: a short poll, bounded by the lease.
        while pending.exists() and time.time() <= expires_at:  # noqa: ASYNC110
            await asyncio.sleep(0.002)

    def load(self, params: dict[str, Any], prompt_tokens: int) -> int:
        """Claim, check and consume a transfer; returns the tokens loaded. SegmentError if
        the transfer cannot be used (the request then recomputes its prompt)."""
        tid, ranks, num_tokens, expires_at = self._check(params, prompt_tokens)
        claimed = []
        try:
            for rank in range(ranks):
                claimed.append(self._claim(tid, rank, expires_at))
            for path in claimed:
                self._read(path, tid, num_tokens)
        finally:
            for path in claimed:
                with contextlib.suppress(OSError):
                    path.unlink()
        return num_tokens

    def _check(self, params: dict[str, Any], prompt_tokens: int) -> tuple[str, int, int, float]:
        # The connector's own checks, in its words (tests/realengine/test_contract.py runs
        # both on one transfer).
        checked = shm.check_params(
            params,
            engine_id=self.engine_id,
            peer_engine_id=self.peer,
            ipc_ns=self.ipc_ns,
            geometry=self.geometry,
            tensor_parallel=self.tp,
            prompt_tokens=prompt_tokens,
        )
        return checked.transfer_id, checked.ranks, checked.num_tokens, checked.expires_at

    def _claim(self, tid: str, rank: int, expires_at: float) -> Path:
        name = segment_name(tid, rank, expires_at)
        path = self.shm_dir / name
        if time.time() > expires_at:
            with contextlib.suppress(OSError):
                path.unlink()
            raise SegmentError(
                f"segment {name} expired {time.time() - expires_at:.1f}s ago "
                "(its lease ended before the decode arrived)"
            )
        claimed = path.with_name(name + ".claimed")
        if not path.exists() and path.with_name(name + ".tmp").exists():
            raise SegmentError(f"the producer's copy had not landed when the lease ended ({name})")
        try:
            os.rename(path, claimed)
            os.utime(claimed)  # the claim's time, which the reaper counts from
        except FileNotFoundError:
            raise SegmentError(shm.not_found(str(path), str(self.shm_dir), self.ipc_ns)) from None
        return claimed

    @staticmethod
    def _read(path: Path, tid: str, num_tokens: int) -> None:
        with open(path, "rb") as fh:
            prefix = fh.read(16)
            if len(prefix) < 16 or prefix[:8] != MAGIC:
                raise SegmentError(f"{path.name} is not a syshax KV segment")
            version = int.from_bytes(prefix[8:12], "little")
            if version != FORMAT_VERSION:
                raise SegmentError(f"segment format {version}, this engine reads {FORMAT_VERSION}")
            length = int.from_bytes(prefix[12:16], "little")
            try:
                header = json.loads(fh.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise SegmentError(f"{path.name} has a corrupt header") from None
        if header.get("transfer_id") != tid or header.get("num_tokens") != num_tokens:
            raise SegmentError(
                f"{path.name} holds transfer {header.get('transfer_id')} of "
                f"{header.get('num_tokens')} tokens, not {tid} of {num_tokens}"
            )

    # -- leases --------------------------------------------------------------------------

    def reap(self, now: float | None = None) -> list[str]:
        """Unlink expired connector segments (any producer's) in the shm dir, as every
        engine with the connector does."""
        now = time.time() if now is None else now
        removed: list[str] = []
        try:
            names = os.listdir(self.shm_dir)
        except FileNotFoundError:
            return removed
        for name in names:
            match = SEGMENT_RE.match(name)
            if match is None:
                continue
            expires = float(match.group("exp"))
            if match.group("state") == ".claimed":
                # A claimed segment whose consumer died: one lease after its claim.
                with contextlib.suppress(FileNotFoundError):
                    expires = os.stat(self.shm_dir / name).st_mtime + self.lease_seconds
            if now > expires:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.shm_dir / name)
                    removed.append(name)
        return removed
