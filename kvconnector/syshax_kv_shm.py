"""Shared memory of the SyshaxShmConnector: the arena, the segment files and their leases.

Standard library only (no vLLM, no torch), so the layout can be read, checked and tested
without an engine. The connector (``syshax_kv_connector.py``) moves the bytes.

The arena (``syshax_kv_arena.py``)
    One file per producing engine and rank, named by arena_name() (the engine id, a hash
    of it, the data-parallel, pipeline and tensor-parallel ranks), owned by one live process
    (an exclusive lock; a second is refused, naming the first). A transfer takes a run of
    consecutive slabs; its layers lie in the run one after another, each aligned to
    ``ALIGN`` bytes.

A segment
    One small file per transfer and rank, ``syshax-kv-<transfer id>-r<rank>-<lease expiry>``:
    ``MAGIC``, the format version, the header's length, then a JSON header that names the
    arena, the run and every layer's offset, shape and dtype. Its life:

    - ``<name>.tmp``: written by the producer's scheduler when it plans the copy (the header
      has the run, no layers yet). A consumer that sees it waits: the copy is under way.
    - ``<name>``: renamed from ``.tmp`` by the producer's worker once every layer's copy has
      landed, with the full header (or with an ``error``, if a copy failed). Its lease
      counts from here (its mtime), never ending before the time its name carries.
    - ``<name>.claimed``: renamed by the consumer that loads it, then touched, so its mtime
      is the claim time; unlinked when the load is done.

    The run is in use while any of these files exists. Every engine with the connector reaps
    expired ones (:func:`reap_expired`): a published or pending segment when its lease ends,
    a claimed one ``claim_grace`` seconds after its claim. So a crash of either engine holds
    a slab no longer than a lease (or the claim grace).

An arena's owner holds an exclusive ``flock`` on it for its life; the reaper removes an
arena nobody holds and no segment points into (:func:`reap_arenas`): a producer that crashed
leaves no arena behind for longer than its segments' leases. A clean shutdown removes it.

A transfer is bound to its prompt: its parameters carry :func:`prompt_digest` of the
prompt's first ``num_tokens`` token ids, the served model and the LoRA adapter, which the
consumer checks against its own prompt (:func:`check_digest`) before loading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

if __package__:  # imported as kvconnector.syshax_kv_shm (the simulator, the tests)
    from . import syshax_kv_arena as arena
else:  # loaded from this directory by an engine, as a top-level module
    import syshax_kv_arena as arena  # type: ignore[no-redef]

ALIGN = arena.ALIGN
ARENA_PREFIX = arena.ARENA_PREFIX
ARENA_RE = arena.ARENA_RE
Arena = arena.Arena
ArenaOwned = arena.ArenaOwned
ArenaView = arena.ArenaView
Run = arena.Run
SlabAllocator = arena.SlabAllocator
arena_name = arena.arena_name
create_arena = arena.create_arena
size = arena.size

MAGIC = b"SYSHAXKV"
FORMAT_VERSION = 2
PREAMBLE = 16  # magic (8), format version (4), header length (4)
HEADER_LIMIT = 1 << 16  # a header larger than this is refused unread
MAX_RANKS = 64  # tensor-parallel ranks a transfer may come from
MAX_LEASE_SECONDS = 3600.0  # a lease further away than this is refused as a lie
SEGMENT_PREFIX = "syshax-kv-"
SEGMENT_RE = re.compile(
    r"^syshax-kv-(?P<tid>[0-9a-f]{32})-r(?P<rank>\d+)-(?P<exp>\d+)"
    r"(?P<state>\.tmp|\.claimed)?$"
)
TRANSFER_ID_RE = re.compile(r"[0-9a-f]{32}")
# dtypes a segment may name, with their size in bytes (torch's names without "torch.").
DTYPE_SIZES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
FORMATS = ("tokens", "pages")


class SegmentError(Exception):
    """A transfer cannot be used; the message names the cause."""


def ipc_namespace() -> str:
    """The IPC namespace of this process (``ipc:[4026531839]``), or ``unknown``."""
    try:
        return os.readlink("/proc/self/ns/ipc")
    except OSError:
        return "unknown"


def segment_name(transfer_id: str, rank: int, expires_at: float) -> str:
    return f"{SEGMENT_PREFIX}{transfer_id}-r{rank}-{int(expires_at)}"


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def open_arena(path: str) -> ArenaView:
    """A consumer's read-only mapping of the arena at ``path``; SegmentError when gone."""
    return arena.open_arena(path, SegmentError)


# ---------------------------------------------------------------------------- segments


def encode_header(header: dict[str, Any]) -> bytes:
    blob = json.dumps(header, separators=(",", ":")).encode()
    if PREAMBLE + len(blob) > HEADER_LIMIT:
        raise ValueError(f"segment header of {len(blob)} bytes exceeds {HEADER_LIMIT}")
    version = FORMAT_VERSION.to_bytes(4, "little")
    return MAGIC + version + len(blob).to_bytes(4, "little") + blob


def write_file(path: str, data: bytes, *, create: bool = True) -> None:
    """``data`` as the whole of ``path``; with ``create`` False a missing file stays missing
    (FileNotFoundError)."""
    flags = os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def segment_header(
    transfer_id: str,
    rank: int,
    *,
    engine_id: str,
    arena_file: str,
    run: Run,
    slab_bytes: int,
    num_tokens: int,
    expires_at: float,
) -> dict[str, Any]:
    """What every header of a transfer's segment says, pending or published: whose it is and
    where its run lies in which arena (``arena_file``, the name arena_name() gave it)."""
    return {
        "transfer_id": transfer_id,
        "rank": rank,
        "producer_engine_id": engine_id,
        "arena": arena_file,
        "run": [run.first, run.count],
        "offset": run.offset(slab_bytes),
        "length": run.length(slab_bytes),
        "num_tokens": num_tokens,
        "lease_expires_at": expires_at,
    }


def read_header(path: str) -> dict[str, Any]:
    """The JSON header of a segment file, with the preamble checked."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(HEADER_LIMIT + 1)
    except FileNotFoundError:
        raise SegmentError(f"segment {name} vanished before it was read") from None
    if len(data) < PREAMBLE or data[:8] != MAGIC:
        raise SegmentError(f"{name} is not a syshax KV segment")
    version = int.from_bytes(data[8:12], "little")
    if version != FORMAT_VERSION:
        raise SegmentError(f"{name} has format {version}; this connector reads {FORMAT_VERSION}")
    length = int.from_bytes(data[12:16], "little")
    if length > len(data) - PREAMBLE:
        raise SegmentError(
            f"{name} is truncated: its header claims {length} bytes, {len(data) - PREAMBLE} follow"
        )
    try:
        header = json.loads(data[PREAMBLE : PREAMBLE + length])
    except (UnicodeDecodeError, ValueError):
        raise SegmentError(f"{name} has a header that is not JSON") from None
    if not isinstance(header, dict):
        raise SegmentError(f"{name} has a header that is not an object")
    return header


def _int(header: dict[str, Any], key: str, low: int, high: int, where: str) -> int:
    value = header.get(key)
    if type(value) is not int or not low <= value <= high:
        raise SegmentError(f"{where}: {key} {value!r} is not an integer in [{low}, {high}]")
    return value


@dataclass(frozen=True)
class LayerPiece:
    """One layer's bytes in an arena: ``nbytes`` at ``offset``, viewed as ``shape``."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


def check_segment(
    header: dict[str, Any], *, arena_size: int, layers: list[str], transfer_id: str, rank: int
) -> dict[str, LayerPiece]:
    """Every size and offset of a published segment, checked against the arena mapping
    before any byte is touched; the pieces by layer name. Raises SegmentError naming the
    field that lies."""
    where = f"segment of transfer {transfer_id} rank {rank}"
    if header.get("error"):
        raise SegmentError(f"the producer could not copy the KV: {header['error']}")
    if header.get("transfer_id") != transfer_id or header.get("rank") != rank:
        raise SegmentError(f"{where}: its header names another transfer or rank")
    if header.get("format") not in FORMATS:
        raise SegmentError(f"{where}: unknown format {show(header.get('format'))}")
    if not isinstance(header.get("layout", {}), dict):
        raise SegmentError(f"{where}: its layout is not an object")
    offset = _int(header, "offset", 0, arena_size, where)
    length = _int(header, "length", 1, arena_size - offset, where)
    pieces = header.get("layers")
    if not isinstance(pieces, dict):
        raise SegmentError(f"{where}: no layer table")
    out: dict[str, LayerPiece] = {}
    for name in layers:
        info = pieces.get(name)
        if not isinstance(info, dict):
            raise SegmentError(f"{where}: no layer {name}")
        at = f"{where}, layer {name}"
        dtype = info.get("dtype")
        if dtype not in DTYPE_SIZES:
            raise SegmentError(f"{at}: dtype {dtype!r} is not one this connector reads")
        shape = info.get("shape")
        if (
            not isinstance(shape, list)
            or not 1 <= len(shape) <= 8
            or any(type(d) is not int or d < 1 for d in shape)
        ):
            raise SegmentError(f"{at}: shape {shape!r} is not a list of positive integers")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        start = _int(info, "offset", offset, offset + length, at)
        if start % ALIGN or start + nbytes > offset + length:
            raise SegmentError(
                f"{at}: {nbytes} bytes at offset {start} lie outside its run "
                f"[{offset}, {offset + length}) of the arena"
            )
        out[name] = LayerPiece(start, nbytes, tuple(shape), dtype)
    return out


# ---------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Checked:
    transfer_id: str
    ranks: int
    num_tokens: int
    expires_at: float


def show(value: Any, limit: int = 64) -> str:
    """``value`` for a message, at most ``limit`` characters; never raises, whatever a client
    sent (a ``repr`` too long or too deep to build names only the type)."""
    try:
        text = repr(value)
    except Exception:  # RecursionError, ValueError of a huge int, ...
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same_geometry(theirs: Any, ours: dict[str, Any]) -> bool:
    """Equal key for key and type for type: ``2.0`` or ``true`` is not the layer count 2."""
    return (
        isinstance(theirs, dict)
        and theirs.keys() == ours.keys()
        and all(type(theirs[k]) is type(v) and theirs[k] == v for k, v in ours.items())
    )


def check_params(
    params: dict[str, Any],
    *,
    engine_id: str,
    peer_engine_id: str | None,
    ipc_ns: str,
    geometry: dict[str, Any],
    tensor_parallel: int,
    prompt_tokens: int,
    max_lease_seconds: float = MAX_LEASE_SECONDS,
    now: float | None = None,
) -> Checked:
    """Every field of a decode's ``kv_transfer_params``, checked before anything is opened;
    SegmentError naming the field that lies, and no other exception whatever the client sent.
    A lease may end at most ``max_lease_seconds`` (and the second the producer rounds up to)
    from ``now``. (Whether it already ended, and the segment's presence, are the caller's:
    they depend on when and where it looks.)"""
    tid = params.get("transfer_id")
    if not isinstance(tid, str) or not TRANSFER_ID_RE.fullmatch(tid):
        raise SegmentError(f"transfer_id {show(tid)} is not a syshax transfer id")
    producer = params.get("producer_engine_id")
    if producer is not None and (not isinstance(producer, str) or len(producer) > 256):
        raise SegmentError(f"producer_engine_id {show(producer)} is not an engine id")
    if peer_engine_id and producer != peer_engine_id:
        raise SegmentError(
            f"transfer {tid} was produced by engine {show(producer, 100)}; this engine "
            f"({engine_id}) decodes for {peer_engine_id!r}"
        )
    their_ns = params.get("ipc_namespace")
    if their_ns is not None and their_ns != ipc_ns:
        ns = their_ns[:64] if isinstance(their_ns, str) else show(their_ns)
        raise SegmentError(
            f"segment is in IPC namespace {ns} and this engine is in "
            f"{ipc_ns}: run the CPU engine in the GPU engine's IPC namespace "
            "(--ipc container:<gpu>)"
        )
    if not _same_geometry(params.get("geometry"), geometry):
        raise SegmentError(
            f"segment geometry {show(params.get('geometry'), 300)} differs from this "
            f"engine's {geometry} (another model or dtype)"
        )
    if tensor_parallel != 1:
        raise SegmentError("a decode engine with tensor parallelism > 1 cannot load segments")
    num_tokens = params.get("num_tokens")
    if type(num_tokens) is not int or not 1 <= num_tokens < prompt_tokens:
        raise SegmentError(
            f"num_tokens {show(num_tokens, 32)} is not in [1, {prompt_tokens - 1}]: the prompt "
            f"of {prompt_tokens} tokens must extend the transferred tokens by at least the "
            "token the prefill sampled"
        )
    ranks = params.get("ranks", 1)
    heads = int(geometry["kv_heads"])
    if type(ranks) is not int or not 1 <= ranks <= min(MAX_RANKS, heads):
        raise SegmentError(f"ranks {show(ranks, 32)} is not in [1, {min(MAX_RANKS, heads)}]")
    if heads % ranks:
        raise SegmentError(f"ranks {ranks} does not divide the model's {heads} KV heads")
    return Checked(tid, ranks, num_tokens, _lease(params, max_lease_seconds, now))


def _lease(params: dict[str, Any], max_lease_seconds: float, now: float | None) -> float:
    expires = params.get("lease_expires_at")
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        raise SegmentError(f"lease_expires_at {show(expires, 32)} is not a number")
    try:
        finite = math.isfinite(expires)
    except OverflowError:  # an integer past any float
        finite = False
    if not finite or expires <= 0:
        raise SegmentError(f"lease_expires_at {show(expires, 32)} is not a time (seconds)")
    now = time.time() if now is None else now
    if expires > now + max_lease_seconds + 1:
        raise SegmentError(
            f"lease_expires_at {show(expires, 32)} ends {expires - now:.0f}s from now, past "
            f"this engine's lease of {max_lease_seconds:.0f}s"
        )
    return float(expires)


def not_found(path: str, shm_dir: str, ipc_ns: str) -> str:
    return (
        f"segment {os.path.basename(path)} not found in {shm_dir} (already used, reaped, or "
        f"written in another IPC namespace; this engine is in {ipc_ns})"
    )


# ---------------------------------------------------------------------------- binding


class Cause(StrEnum):
    """Why a transfer was not used as planned: each is counted (:class:`Tally`) and named in
    its log line. The values are what logs and ``SyshaxShmConnector.counts()`` say."""

    REFUSED = "refused"  # a field of the parameters failed its check
    DIGEST_MISMATCH = "digest_mismatch"  # the KV is of another prompt, model or adapter
    DIGEST_MISSING = "digest_missing"  # parameters from before the digest: not loaded
    LOCAL_HIT = "local_hit"  # the consumer's own cache held it all: released at once
    LOAD_FAILED = "load_failed"  # the load failed after the checks
    HOST_REGISTER = "host_register_failed"  # CUDA refused the arena: every prefill falls back
    ARENA_FULL = "arena_full"  # no run free for the transfer
    SAVE_FAILED = "save_failed"  # the producer's copy failed (published with the error)


class Tally(Counter[str]):
    """How often each :class:`Cause` happened in this engine."""

    def add(self, cause: Cause) -> int:
        """Count ``cause`` once; how often it has happened now."""
        self[cause.value] += 1
        return self[cause.value]


def prompt_digest(token_ids: Sequence[int], model: str, adapter: str | None) -> str:
    """What binds a transfer to its prompt: a hash of the served model's name, the LoRA
    adapter's (empty without one) and the token ids, each as eight little-endian bytes."""
    h = hashlib.sha256()
    for part in (model, adapter or ""):
        blob = part.encode("utf-8", "surrogatepass")
        h.update(len(blob).to_bytes(4, "little") + blob)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids))
    return "sha256:" + h.hexdigest()


def check_digest(
    params: dict[str, Any], token_ids: Sequence[int], model: str, adapter: str | None
) -> Cause | None:
    """None when ``params`` carry the digest of ``token_ids`` (the decode's own prompt, cut
    at the transfer's ``num_tokens``), ``model`` and ``adapter``; otherwise why not:
    DIGEST_MISSING for parameters without one (produced before the digest existed, or
    stripped), DIGEST_MISMATCH for another prompt, model or adapter."""
    theirs = params.get("prompt_digest")
    if theirs is None:
        return Cause.DIGEST_MISSING
    if not isinstance(theirs, str) or theirs != prompt_digest(token_ids, model, adapter):
        return Cause.DIGEST_MISMATCH
    return None


# ---------------------------------------------------------------------------- leases


def transfer_files(shm_dir: str, transfer_id: str, ranks: int, expires_at: float) -> list[str]:
    """Paths of every file that may exist for a transfer, all ranks and states."""
    paths = []
    for rank in range(ranks):
        base = os.path.join(shm_dir, segment_name(transfer_id, rank, expires_at))
        paths += [base, base + ".tmp", base + ".claimed"]
    return paths


def transfer_alive(shm_dir: str, transfer_id: str, ranks: int, expires_at: float) -> bool:
    return any(os.path.exists(p) for p in transfer_files(shm_dir, transfer_id, ranks, expires_at))


def unlink_transfer(shm_dir: str, transfer_id: str, ranks: int, expires_at: float) -> None:
    for path in transfer_files(shm_dir, transfer_id, ranks, expires_at):
        with contextlib.suppress(OSError):
            os.unlink(path)


def reap_expired(
    shm_dir: str, *, claim_grace: float, lease: float = 0.0, now: float | None = None
) -> list[str]:
    """Unlink expired segments (any producer's) in ``shm_dir``; returns their names.

    A pending segment expires at the time its name carries (its copy must land by then); a
    published one ``lease`` seconds after its publication (its mtime) and never before its
    name's time; a claimed one ``claim_grace`` seconds after its claim (its mtime), so a
    consumer that died mid-load frees the run."""
    now = time.time() if now is None else now
    removed = []
    for name in os.listdir(shm_dir):
        match = SEGMENT_RE.match(name)
        if match is None:
            continue
        path = os.path.join(shm_dir, name)
        state = match.group("state")
        named = float(match.group("exp"))
        try:
            if state == ".claimed":
                expires = os.stat(path).st_mtime + claim_grace
            elif state is None:
                expires = max(named, os.stat(path).st_mtime + lease)
            else:
                expires = named
        except FileNotFoundError:
            continue
        if now > expires:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
    return removed


def lease_end(path: str, named: float, lease: float) -> float:
    """When the lease of the published segment at ``path`` ends: ``lease`` seconds after its
    publication, never before the time its name carries; ``named`` when it is not there."""
    try:
        return max(named, os.stat(path).st_mtime + lease)
    except OSError:
        return named


def reap_arenas(shm_dir: str) -> list[str]:
    """Unlink the arenas in ``shm_dir`` whose owner is gone (nobody holds their lock) and
    into which no segment points any more, with their owner records; returns their names."""
    removed: list[str] = []
    referenced: set[str] | None = None
    for name in os.listdir(shm_dir):
        if not name.startswith(ARENA_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        fd = arena.unowned(path)
        if fd is None:
            continue  # its producer is alive
        try:
            if referenced is None:
                referenced = _referenced_arenas(shm_dir)
            if name in referenced or os.stat(path).st_ino != os.fstat(fd).st_ino:
                continue
            os.unlink(path)
            with contextlib.suppress(OSError):
                os.unlink(arena.owner_path(path))
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _referenced_arenas(shm_dir: str) -> set[str]:
    names = set()
    for name in os.listdir(shm_dir):
        if SEGMENT_RE.match(name):
            with contextlib.suppress(SegmentError):
                named = read_header(os.path.join(shm_dir, name)).get("arena")
                if isinstance(named, str):
                    names.add(named)
    return names


def live_runs(shm_dir: str, arena_file: str) -> list[tuple[str, Run, int, float]]:
    """(transfer id, run, rank, lease expiry) of every segment file in ``shm_dir`` that points
    into ``arena_file``: what a restarted producer must not hand out again. Unreadable files are
    skipped (the reaper removes them at their lease)."""
    found = []
    for name in os.listdir(shm_dir):
        match = SEGMENT_RE.match(name)
        if match is None:
            continue
        try:
            header = read_header(os.path.join(shm_dir, name))
        except SegmentError:
            continue
        if header.get("arena") != arena_file:
            continue
        run = header.get("run")
        if (
            not isinstance(run, list)
            or len(run) != 2
            or not all(type(v) is int and v >= 0 for v in run)
        ):
            continue
        found.append(
            (
                match.group("tid"),
                Run(run[0], max(1, run[1])),
                int(match.group("rank")),
                float(match.group("exp")),
            )
        )
    return found
