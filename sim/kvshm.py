"""KV handoff through POSIX shared memory, sysHAX style (``--syshax-compat``).

A segment is a file under the shm directory (``/dev/shm`` = the container's IPC namespace)
named after the sequence. It is sized like the real KV state (KV bytes per token x tokens,
via ftruncate, so it costs no RAM until touched); the payload is synthetic, but a header
carries magic, ids, token count, lease expiry and a checksum that the reader verifies, so a
wrong, stale, foreign or torn segment is refused instead of silently decoded.

Errors are ``HandoffError`` with the HTTP status and message the API returns.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from sim.connector import is_connector_segment

MAGIC = b"SXKVSEG1"
# The header is the body then a CRC32 of the body; one format so the two cannot drift.
_BODY = struct.Struct("<8sI128s64s128sQQddQ32s")
HEADER = struct.Struct(_BODY.format + "I")
PAYLOAD_OFFSET = 4096  # the synthetic KV starts on its own page
SEGMENT_PREFIX = "syshax-kv-"
_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class HandoffError(Exception):
    def __init__(self, status: int, message: str, param: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type


@dataclass(frozen=True)
class Segment:
    path: Path
    request_id: str
    engine_id: str
    model: str
    tokens: int
    kv_bytes_per_token: int
    created: float
    expires: float
    data_size: int


def check_id(value: str, param: str) -> str:
    if not _ID_RE.match(value):
        raise HandoffError(
            400,
            f"{param} {value[:80]!r} is not an id this engine family issues "
            "(1-128 characters of A-Z a-z 0-9 . _ : -)",
            param,
            "BadRequestError",
        )
    return value


def segment_path(shm_dir: Path, key: str) -> Path:
    return shm_dir / f"{SEGMENT_PREFIX}{key}"


def _fingerprint(request_id: str, tokens: int) -> bytes:
    # The synthetic KV payload: a digest of what the KV would depend on.
    return hashlib.sha256(f"{request_id}:{tokens}".encode()).digest()


def _pack(seg: Segment) -> bytes:
    fields = (
        MAGIC,
        1,
        seg.request_id.encode()[:128],
        seg.engine_id.encode()[:64],
        seg.model.encode()[:128],
        seg.tokens,
        seg.kv_bytes_per_token,
        seg.created,
        seg.expires,
        seg.data_size,
        _fingerprint(seg.request_id, seg.tokens),
    )
    body = _BODY.pack(*fields)
    return body + struct.pack("<I", zlib.crc32(body))


def publish(
    shm_dir: Path,
    key: str,
    *,
    request_id: str,
    engine_id: str,
    model: str,
    tokens: int,
    kv_bytes_per_token: int,
    lease_seconds: float,
) -> Segment:
    """Write a segment atomically (temp file + rename) so readers never see half of one."""
    now = time.time()
    seg = Segment(
        path=segment_path(shm_dir, key),
        request_id=request_id,
        engine_id=engine_id,
        model=model,
        tokens=tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        created=now,
        expires=now + lease_seconds,
        data_size=tokens * kv_bytes_per_token,
    )
    tmp = seg.path.with_name(f".{seg.path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, PAYLOAD_OFFSET + seg.data_size)
        os.pwrite(fd, _pack(seg), 0)
        os.pwrite(fd, _fingerprint(request_id, tokens), PAYLOAD_OFFSET)
    finally:
        os.close(fd)
    os.replace(tmp, seg.path)
    return seg


def read_header(path: Path) -> Segment:
    """Parse and verify a segment's header; raises ValueError on anything torn or foreign."""
    with open(path, "rb") as fh:
        raw = fh.read(HEADER.size)
        fh.seek(PAYLOAD_OFFSET)
        payload = fh.read(32)
        size = os.fstat(fh.fileno()).st_size
    if len(raw) < HEADER.size:
        raise ValueError("short header")
    magic, version, rid, eid, model, tokens, kvbpt, created, expires, data_size, fp, crc = (
        HEADER.unpack(raw)
    )
    if magic != MAGIC or version != 1:
        raise ValueError("bad magic")
    if zlib.crc32(raw[:-4]) != crc:
        raise ValueError("header checksum mismatch")
    request_id = rid.rstrip(b"\0").decode()
    if payload != fp or fp != _fingerprint(request_id, tokens):
        raise ValueError("payload checksum mismatch")
    if size != PAYLOAD_OFFSET + data_size or data_size != tokens * kvbpt:
        raise ValueError("segment size does not match its token count")
    return Segment(
        path=path,
        request_id=request_id,
        engine_id=eid.rstrip(b"\0").decode(),
        model=model.rstrip(b"\0").decode(),
        tokens=tokens,
        kv_bytes_per_token=kvbpt,
        created=created,
        expires=expires,
        data_size=data_size,
    )


def open_segment(
    shm_dir: Path,
    key: str,
    *,
    param: str,
    model: str,
    kv_bytes_per_token: int,
    expected_tokens: int,
    expected_engine_id: str | None = None,
) -> Segment:
    """Find, verify and claim (unlink) the segment of ``key``; HandoffError if unusable."""
    path = segment_path(shm_dir, key)
    if not path.exists():
        raise HandoffError(
            404,
            f"no KV segment for {param}={key!r} at {path}: it was never published in this "
            "IPC namespace, was already consumed, or was reclaimed after its lease. If the "
            "prefill engine published it, this engine is not in that engine's IPC namespace "
            "(run it with --ipc container:<prefill container>) or uses another --shm-dir.",
            param,
            "NotFoundError",
        )
    try:
        seg = read_header(path)
    except (OSError, ValueError) as exc:
        raise HandoffError(
            409, f"KV segment {path} is corrupt ({exc})", param, "ConflictError"
        ) from None
    problem = None
    if expected_engine_id is not None and seg.engine_id != expected_engine_id:
        problem = (
            f"KV segment {path} was published by engine {seg.engine_id!r}, "
            f"not by remote_engine_id {expected_engine_id!r}"
        )
    elif seg.model != model or seg.kv_bytes_per_token != kv_bytes_per_token:
        problem = (
            f"KV segment {path} holds KV of model {seg.model!r} "
            f"({seg.kv_bytes_per_token} B/token); this engine serves {model!r} "
            f"({kv_bytes_per_token} B/token)"
        )
    elif seg.tokens != expected_tokens:
        problem = (
            f"KV segment {path} holds {seg.tokens} tokens but this request's prompt and "
            f"generated text need {expected_tokens}: wrong {param}, or generated_text does "
            "not match what was generated"
        )
    if problem:
        raise HandoffError(409, problem, param, "ConflictError")
    if seg.expires < time.time():
        _unlink(path)
        raise HandoffError(
            410,
            f"the lease of KV segment {path} expired {time.time() - seg.expires:.2f} s ago "
            "(--kv-lease-seconds); the prefill has to run again",
            param,
            "GoneError",
        )
    _unlink(path)  # claimed: a sequence's KV lives in one engine at a time
    return seg


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def reap(shm_dir: Path, *, now: float | None = None, min_grace: float = 1.0) -> list[Path]:
    """Unlink segments whose lease ended more than one lease (at least ``min_grace`` s) ago.

    The grace keeps an expired segment visible for a while so a late reader gets the clear
    "lease expired" error rather than "missing". Unreadable segment files are judged by
    their modification time.
    """
    now = time.time() if now is None else now
    reclaimed: list[Path] = []
    try:
        entries = list(shm_dir.iterdir())
    except FileNotFoundError:
        return reclaimed
    for path in entries:
        name = path.name
        if not (name.startswith(SEGMENT_PREFIX) or name.startswith("." + SEGMENT_PREFIX)):
            continue
        if is_connector_segment(name):
            continue  # the connector's own naming carries its lease (connector.reap)
        try:
            seg = read_header(path)
            deadline = seg.expires + max(min_grace, seg.expires - seg.created)
        except (OSError, ValueError):
            try:
                deadline = path.stat().st_mtime + 60.0
            except FileNotFoundError:
                continue
        if deadline < now and _unlink(path):
            reclaimed.append(path)
    return reclaimed
