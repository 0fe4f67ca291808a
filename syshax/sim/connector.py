"""The simulator's side of the SyshaxShmConnector contract (syshax/kvconnector/).

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
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syshax.common.presets import ModelPreset

CONNECTOR_NAME = "SyshaxShmConnector"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
MAGIC = b"SYSHAXKV"
FORMAT_VERSION = 1
HEADER_SPACE = 1 << 16
SEGMENT_RE = re.compile(
    r"^syshax-kv-(?P<tid>[0-9a-f]{32})-r(?P<rank>\d+)-(?P<exp>\d+)(?P<claimed>\.claimed)?$"
)
CLAIM_GRACE_SECONDS = 60.0  # a claimed segment whose consumer died is reaped this much later


class SegmentError(Exception):
    """A transfer's segment cannot be used; the message names the cause."""


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``--kv-transfer-config`` says; None where it says nothing."""

    kv_role: str
    engine_id: str | None = None
    peer_engine_id: str | None = None
    shm_dir: Path | None = None
    lease_seconds: float | None = None


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
    engine_id = extra.get("engine_id") or raw.get("engine_id")
    return ConnectorConfig(
        kv_role=role,
        engine_id=str(engine_id) if engine_id else None,
        peer_engine_id=str(extra["peer_engine_id"]) if extra.get("peer_engine_id") else None,
        shm_dir=Path(str(extra["shm_dir"])) if extra.get("shm_dir") else None,
        lease_seconds=lease_seconds,
    )


def ipc_namespace() -> str:
    """The IPC namespace of this process (``ipc:[4026531839]``), or ``unknown``."""
    try:
        return os.readlink("/proc/self/ns/ipc")
    except OSError:
        return "unknown"


def segment_name(transfer_id: str, rank: int, expires_at: float) -> str:
    return f"syshax-kv-{transfer_id}-r{rank}-{int(expires_at)}"


def is_connector_segment(name: str) -> bool:
    return SEGMENT_RE.match(name.removesuffix(".tmp")) is not None


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
    ) -> None:
        self.engine_id = engine_id
        self.peer = peer_engine_id
        self.shm_dir = shm_dir
        self.lease_seconds = lease_seconds
        self.model = model
        self.tp = tensor_parallel_size
        self.ipc_ns = ipc_namespace()
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
        """Write the segments of a prefill's ``num_tokens`` prompt tokens (one per rank);
        returns the transfer's ``kv_transfer_params``."""
        tid = uuid.uuid4().hex
        expires_at = int(time.time() + self.lease_seconds)
        for rank in range(self.tp):
            self._write(tid, rank, num_tokens, expires_at)
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
        os.rename(tmp, self.shm_dir / name)

    # -- consumer ------------------------------------------------------------------------

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
        # The same checks, in the same words, as SyshaxShmConnector._check_transfer: that file is
        # loaded into vLLM on its own (torch and vllm at its top), so the simulator cannot share
        # it and mirrors the contract; tests/realengine/test_contract.py runs both on one transfer.
        tid = str(params.get("transfer_id", ""))
        if not re.fullmatch(r"[0-9a-f]{32}", tid):
            raise SegmentError(f"transfer_id {tid!r} is not a syshax transfer id")
        producer = params.get("producer_engine_id")
        if self.peer and producer != self.peer:
            raise SegmentError(
                f"transfer {tid} was produced by engine {producer!r}; this engine "
                f"({self.engine_id}) decodes for {self.peer!r}"
            )
        their_ns = params.get("ipc_namespace")
        if their_ns and their_ns != self.ipc_ns:
            raise SegmentError(
                f"segment is in IPC namespace {their_ns} and this engine is in {self.ipc_ns}:"
                " run the CPU engine in the GPU engine's IPC namespace (--ipc container:<gpu>)"
            )
        if params.get("geometry") != self.geometry:
            raise SegmentError(
                f"segment geometry {params.get('geometry')} differs from this engine's "
                f"{self.geometry} (another model or dtype)"
            )
        try:
            num_tokens = int(params["num_tokens"])
            ranks = int(params.get("ranks", 1))
            expires_at = float(params["lease_expires_at"])
        except (KeyError, TypeError, ValueError):
            raise SegmentError("kv_transfer_params lack num_tokens/lease_expires_at") from None
        if self.tp != 1:
            raise SegmentError("a decode engine with tensor parallelism > 1 cannot load segments")
        if num_tokens >= prompt_tokens:
            raise SegmentError(
                f"the prompt has {prompt_tokens} tokens; it must extend the {num_tokens} "
                "transferred tokens by at least the token the prefill sampled"
            )
        return tid, ranks, num_tokens, expires_at

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
        try:
            os.rename(path, claimed)
        except FileNotFoundError:
            raise SegmentError(
                f"segment {name} not found in {self.shm_dir} (already used, reaped, or "
                f"written in another IPC namespace; this engine is in {self.ipc_ns})"
            ) from None
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
            match = SEGMENT_RE.match(name.removesuffix(".tmp"))
            if match is None:
                continue
            expires = int(match.group("exp"))
            if match.group("claimed"):
                expires += int(CLAIM_GRACE_SECONDS)
            if now > expires + (CLAIM_GRACE_SECONDS if name.endswith(".tmp") else 0):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.shm_dir / name)
                    removed.append(name)
        return removed
