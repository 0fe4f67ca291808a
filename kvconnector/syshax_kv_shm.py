"""Shared memory of the SyshaxShmConnector: the arena, the segment files and their leases.

Standard library only (no vLLM, no torch), so the layout can be read, checked and tested
without an engine. The connector (``syshax_kv_connector.py``) moves the bytes.

The arena
    One file per producing engine and tensor-parallel rank,
    ``<shm_dir>/syshax-arena-<engine id>-r<rank>``, of ``slabs x slab_bytes`` bytes, created
    once when the engine starts: space reserved with ``posix_fallocate`` (a full tmpfs is a
    clear error at start, not a SIGBUS later), pages faulted in, and on CUDA registered with
    the driver so copies into it are DMA. A transfer takes a run of consecutive slabs; its
    layers lie in the run one after another, each aligned to ``ALIGN`` bytes.

A segment
    One small file per transfer and rank, ``syshax-kv-<transfer id>-r<rank>-<lease expiry>``:
    ``MAGIC``, the format version, the header's length, then a JSON header that names the
    arena, the run and every layer's offset, shape and dtype. Its life:

    - ``<name>.tmp``: written by the producer's scheduler when it plans the copy (the header
      has the run, no layers yet). A consumer that sees it waits: the copy is under way.
    - ``<name>``: renamed from ``.tmp`` by the producer's worker once every layer's copy has
      landed, with the full header (or with an ``error``, if a copy failed).
    - ``<name>.claimed``: renamed by the consumer that loads it, then touched, so its mtime
      is the claim time; unlinked when the load is done.

    The run is in use while any of these files exists. Every engine with the connector reaps
    expired ones (:func:`reap_expired`): a published or pending segment when its lease ends,
    a claimed one ``claim_grace`` seconds after its claim. So a crash of either engine holds
    a slab no longer than a lease (or the claim grace).

An arena's owner holds a shared ``flock`` on it for its life; the reaper removes an arena
nobody holds and no segment points into (:func:`reap_arenas`): a producer that crashed
leaves no arena behind for longer than its segments' leases. A clean shutdown removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import mmap
import os
import re
import time
from dataclasses import dataclass
from typing import Any

MAGIC = b"SYSHAXKV"
FORMAT_VERSION = 2
PREAMBLE = 16  # magic (8), format version (4), header length (4)
HEADER_LIMIT = 1 << 16  # a header larger than this is refused unread
ALIGN = 4096  # every layer's bytes start on a page
MAX_RANKS = 64  # tensor-parallel ranks a transfer may come from
MAX_LEASE_SECONDS = 3600.0  # a lease further away than this is refused as a lie
SEGMENT_PREFIX = "syshax-kv-"
ARENA_PREFIX = "syshax-arena-"
SEGMENT_RE = re.compile(
    r"^syshax-kv-(?P<tid>[0-9a-f]{32})-r(?P<rank>\d+)-(?P<exp>\d+)"
    r"(?P<state>\.tmp|\.claimed)?$"
)
TRANSFER_ID_RE = re.compile(r"[0-9a-f]{32}")
# What arena_name() makes: one file name in the shm directory, no separator, nothing above it.
ARENA_RE = re.compile(r"syshax-arena-[A-Za-z0-9._-]{1,100}-r\d{1,3}")
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
# Linux 5.14's madvise advices; older kernels answer EINVAL and pages fault in on first use.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


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


def arena_name(engine_id: str, rank: int) -> str:
    """The arena's file name: the engine id with anything but ``[A-Za-z0-9._-]`` replaced."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)[:100] or "engine"
    return f"{ARENA_PREFIX}{safe}-r{rank}"


def size(nbytes: int) -> str:
    """``nbytes`` for a message: MiB from one MiB up, KiB below."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


# ---------------------------------------------------------------------------- the arena


@dataclass(frozen=True)
class Run:
    """Consecutive slabs ``first .. first + count - 1`` of an arena."""

    first: int
    count: int

    def offset(self, slab_bytes: int) -> int:
        return self.first * slab_bytes

    def length(self, slab_bytes: int) -> int:
        return self.count * slab_bytes


class SlabAllocator:
    """First-fit runs of fixed-size slabs: bookkeeping only, no memory."""

    def __init__(self, slabs: int, slab_bytes: int) -> None:
        if slabs < 0 or slab_bytes < ALIGN or slab_bytes % ALIGN:
            raise ValueError(f"bad arena shape: {slabs} slabs of {slab_bytes} bytes")
        self.slabs = slabs
        self.slab_bytes = slab_bytes
        self._used = bytearray(slabs)

    @property
    def capacity(self) -> int:
        return self.slabs * self.slab_bytes

    def slabs_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slab_bytes))

    def largest_free_run(self) -> int:
        best = length = 0
        for used in self._used:
            length = 0 if used else length + 1
            best = max(best, length)
        return best

    def allocate(self, nbytes: int) -> Run | None:
        """A run that holds ``nbytes``, marked used; None when no run is free."""
        want = self.slabs_for(nbytes)
        start = length = 0
        for i, used in enumerate(self._used):
            if used:
                start, length = i + 1, 0
                continue
            length += 1
            if length == want:
                self.mark(Run(start, want), True)
                return Run(start, want)
        return None

    def mark(self, run: Run, used: bool) -> None:
        if run.first < 0 or run.count < 1 or run.first + run.count > self.slabs:
            raise ValueError(f"run {run} is outside the arena's {self.slabs} slabs")
        self._used[run.first : run.first + run.count] = bytes([used]) * run.count


def _populate(mm: mmap.mmap, advice: int) -> None:
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(advice)


@dataclass
class Arena:
    """A producer's arena: its mapping, and the open file whose shared lock says that its
    owner is alive."""

    path: str
    fd: int
    buffer: mmap.mmap

    def close(self, *, unlink: bool) -> None:
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        with contextlib.suppress(BufferError, ValueError):
            self.buffer.close()  # tensors over it may still be alive: the exit frees it then
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _open_held(path: str) -> int:
    """``path`` opened (created if missing) with a shared lock held on that very file: one
    the reaper removed between the open and the lock is opened again."""
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(f"the KV arena {path} was removed three times while it was being opened")


def create_arena(path: str, size: int) -> Arena:
    """The producer's arena, ``size`` bytes at ``path``, mapped read-write and faulted in,
    held (a shared lock) for as long as it is open.

    An existing file of that name (this engine's own, from before a restart) is reused: live
    segments may still point into it. Raises OSError naming the directory and the shortfall
    when its file system cannot hold ``size`` bytes."""
    fd = _open_held(path)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            stat = os.statvfs(os.path.dirname(path) or ".")
            free = stat.f_bavail * stat.f_frsize
            raise OSError(
                exc.errno,
                f"cannot reserve a {size / 2**20:.0f} MiB KV arena in {os.path.dirname(path)} "
                f"({free / 2**20:.0f} MiB free): give the GPU container a larger /dev/shm "
                "(--shm-size, the profile's gpu_shm_size_gb) or a smaller arena_mib",
            ) from None
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    _populate(mm, MADV_POPULATE_WRITE)
    return Arena(path, fd, mm)


@dataclass
class ArenaView:
    """A consumer's read-only mapping of a producer's arena."""

    path: str
    inode: int
    size: int
    buffer: mmap.mmap


def open_arena(path: str) -> ArenaView:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SegmentError(f"the producer's arena {os.path.basename(path)} is gone") from None
    try:
        stat = os.fstat(fd)
        if stat.st_size == 0:
            raise SegmentError(f"the producer's arena {os.path.basename(path)} is empty")
        mm = mmap.mmap(fd, stat.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    _populate(mm, MADV_POPULATE_READ)
    return ArenaView(path, stat.st_ino, stat.st_size, mm)


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
    run: Run,
    slab_bytes: int,
    num_tokens: int,
    expires_at: float,
) -> dict[str, Any]:
    """What every header of a transfer's segment says, pending or published: whose it is and
    where its run lies in which arena."""
    return {
        "transfer_id": transfer_id,
        "rank": rank,
        "producer_engine_id": engine_id,
        "arena": arena_name(engine_id, rank),
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


def reap_expired(shm_dir: str, *, claim_grace: float, now: float | None = None) -> list[str]:
    """Unlink expired segments (any producer's) in ``shm_dir``; returns their names.

    A published or pending segment expires with its lease; a claimed one ``claim_grace``
    seconds after its claim (its mtime), so a consumer that died mid-load frees the run."""
    now = time.time() if now is None else now
    removed = []
    for name in os.listdir(shm_dir):
        match = SEGMENT_RE.match(name)
        if match is None:
            continue
        path = os.path.join(shm_dir, name)
        if match.group("state") == ".claimed":
            try:
                expires = os.stat(path).st_mtime + claim_grace
            except FileNotFoundError:
                continue
        else:
            expires = int(match.group("exp"))
        if now > expires:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
    return removed


def reap_arenas(shm_dir: str) -> list[str]:
    """Unlink the arenas in ``shm_dir`` whose owner is gone (nobody holds their lock) and
    into which no segment points any more; returns their names."""
    removed: list[str] = []
    referenced: set[str] | None = None
    for name in os.listdir(shm_dir):
        if not name.startswith(ARENA_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its producer is alive
            if referenced is None:
                referenced = _referenced_arenas(shm_dir)
            if name in referenced or os.stat(path).st_ino != os.fstat(fd).st_ino:
                continue
            os.unlink(path)
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
                arena = read_header(os.path.join(shm_dir, name)).get("arena")
                if isinstance(arena, str):
                    names.add(arena)
    return names


def live_runs(shm_dir: str, arena: str) -> list[tuple[str, Run, int, float]]:
    """(transfer id, run, rank, lease expiry) of every segment file in ``shm_dir`` that points
    into ``arena``: what a restarted producer must not hand out again. Unreadable files are
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
        if header.get("arena") != arena:
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
