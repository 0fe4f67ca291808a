"""The producer's arena: its name, its one owner, its slabs. Standard library only.

One file per producing engine and rank, ``<shm_dir>/<arena_name(...)>``, of ``slabs x
slab_bytes`` bytes, created once when the engine starts: space reserved with
``posix_fallocate`` (a full tmpfs is a clear error at start, not a SIGBUS later), pages
faulted in, and on CUDA registered with the driver so copies into it are DMA. A transfer
takes a run of consecutive slabs.

One arena, one owner. The name carries the engine id (its safe characters, cut), a hash of
the whole id, and the data-parallel, pipeline and tensor-parallel ranks, so two engines (or
two ranks of one) never compute one name unless they are the same rank of the same engine.
The owner holds an *exclusive*, non-blocking ``flock`` on the file for its life and writes
who it is (pid, engine id, whether CUDA registered the arena) beside it, in
``syshax-owner-<arena name>``; a second process that opens the same arena while the first
lives is refused, naming the first. A file nobody holds (the owner crashed) is reused by the
same engine when it restarts: live segments may still point into it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import re
import time
from dataclasses import dataclass
from typing import Any

ALIGN = 4096  # every layer's bytes start on a page
ARENA_PREFIX = "syshax-arena-"
OWNER_PREFIX = "syshax-owner-"
# What arena_name() makes: one file name in the shm directory, no separator, nothing above it.
ARENA_RE = re.compile(
    r"syshax-arena-[A-Za-z0-9._-]{1,48}-[0-9a-f]{12}-dp\d{1,4}-pp\d{1,3}-r\d{1,3}"
)
# Linux 5.14's madvise advices; older kernels answer EINVAL and pages fault in on first use.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# How long a second opener retries a held lock: a reaper holds one for microseconds.
LOCK_RETRY_SECONDS = 0.2


class ArenaOwned(OSError):
    """Another live process owns the arena; the message names it."""


def arena_name(engine_id: str, rank: int, *, dp_rank: int = 0, pp_rank: int = 0) -> str:
    """The arena's file name. The readable part is the engine id's ``[A-Za-z0-9._-]``
    characters, cut at 48; the hash of the whole id keeps ids that differ only in what was
    replaced or cut apart."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)[:48] or "engine"
    digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{ARENA_PREFIX}{safe}-{digest}-dp{dp_rank}-pp{pp_rank}-r{rank}"


def owner_path(arena_path: str) -> str:
    folder, name = os.path.split(arena_path)
    return os.path.join(folder, OWNER_PREFIX + name)


def read_owner(arena_path: str) -> dict[str, Any] | None:
    """What the arena's owner wrote of itself, or None (no owner file, or not readable)."""
    try:
        with open(owner_path(arena_path), "rb") as fh:
            record = json.loads(fh.read(4096))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_owner(arena_path: str, record: dict[str, Any]) -> None:
    """The owner's record, replaced whole (a reader never sees half of it)."""
    path = owner_path(arena_path)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)


def size(nbytes: int) -> str:
    """``nbytes`` for a message: MiB from one MiB up, KiB below."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"


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


def populate(mm: mmap.mmap, advice: int) -> None:
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(advice)


@dataclass
class Arena:
    """A producer's arena: its mapping, and the open file whose exclusive lock says that
    its owner is alive."""

    path: str
    fd: int
    buffer: mmap.mmap

    def close(self, *, unlink: bool) -> None:
        if unlink:
            for path in (self.path, owner_path(self.path)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        with contextlib.suppress(BufferError, ValueError):
            self.buffer.close()  # tensors over it may still be alive: the exit frees it then
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _refusal(path: str) -> ArenaOwned:
    owner = read_owner(path) or {}
    who = (
        f"engine {owner.get('engine_id')!r}, pid {owner.get('pid')}"
        if owner
        else "a process that wrote no owner record"
    )
    return ArenaOwned(
        f"the KV arena {path} is owned by {who}: two engines cannot share one arena. Give "
        "each engine its own engine_id (kv_connector_extra_config) or its own shm_dir"
    )


def _open_owned(path: str) -> int:
    """``path`` opened (created if missing) with an exclusive lock held on that very file;
    one the reaper removed between the open and the lock is opened again. Raises
    ArenaOwned when another live process holds it."""
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_RETRY_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise _refusal(path) from None
                time.sleep(0.01)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(f"the KV arena {path} was removed three times while it was being opened")


def create_arena(path: str, nbytes: int, *, owner: dict[str, Any] | None = None) -> Arena:
    """The producer's arena, ``nbytes`` at ``path``, mapped read-write and faulted in, owned
    (an exclusive lock, and ``owner`` written beside it) for as long as it is open.

    A file nobody holds (this engine's own, from before a crash) is reused: live segments may
    still point into it. One another live process holds raises ArenaOwned naming it. Raises
    OSError naming the directory and the shortfall when its file system cannot hold it."""
    fd = _open_owned(path)
    try:
        if os.fstat(fd).st_size != nbytes:
            os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            stat = os.statvfs(os.path.dirname(path) or ".")
            free = stat.f_bavail * stat.f_frsize
            raise OSError(
                exc.errno,
                f"cannot reserve a {nbytes / 2**20:.0f} MiB KV arena in {os.path.dirname(path)} "
                f"({free / 2**20:.0f} MiB free): give the GPU container a larger /dev/shm "
                "(--shm-size, the profile's gpu_shm_size_gb) or a smaller arena_mib",
            ) from None
        mm = mmap.mmap(fd, nbytes)
        write_owner(path, {"pid": os.getpid(), **(owner or {})})
    except BaseException:
        os.close(fd)
        raise
    populate(mm, MADV_POPULATE_WRITE)
    return Arena(path, fd, mm)


@dataclass
class ArenaView:
    """A consumer's read-only mapping of a producer's arena."""

    path: str
    inode: int
    size: int
    buffer: mmap.mmap


def open_arena(path: str, error: type[Exception]) -> ArenaView:
    """A read-only mapping of the arena at ``path``; ``error`` (naming the cause) when it
    is gone or empty."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise error(f"the producer's arena {os.path.basename(path)} is gone") from None
    try:
        stat = os.fstat(fd)
        if stat.st_size == 0:
            raise error(f"the producer's arena {os.path.basename(path)} is empty")
        mm = mmap.mmap(fd, stat.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    populate(mm, MADV_POPULATE_READ)
    return ArenaView(path, stat.st_ino, stat.st_size, mm)


def unowned(path: str) -> int | None:
    """A descriptor of ``path`` with its exclusive lock taken (its owner is gone), or None
    while its owner lives or the file cannot be opened. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
