"""The producer's saves: the arena it owns, the step's gather into it, and publication
(docs/kv-connector.md).

Every save is gathered in ``wait_for_save``, which vLLM calls after each step's forward (a
draft model's included) and which no CUDA graph skips: a uniform-decode step replayed as a
full graph saves the prefills it finishes like any other step. Per step and layer one
gather covers every store of the step; on CUDA the gathered layers go to the arena on a side
stream through at most ``staging_mib`` of device buffers (the compute stream waits on the
device, never the host, before it reuses one), and one completion event is recorded after
the step's last copy. On the CPU the gather writes into the arena directly, the one copy
there is.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import syshax_kv_shm as shm
import torch
from syshax_kv_plan import Engine, StoreOp, SyshaxShmMetadata, cause, engine_broken
from vllm.logger import init_logger

logger = init_logger("vllm.syshax_kv_connector")
# Attention backends whose page view holds each token's K|V as one row (vLLM 0.32's CUDA
# backends): they write and read the per-token segment format.
PLAIN_TOKEN_BACKENDS = frozenset({"FlashAttentionImpl", "TritonAttentionImpl"})
# The CPU backend: keys then values inside a page, packed per instruction set; copied whole.
PAGE_BACKENDS = frozenset({"CPUAttentionBackendImpl"})
SPOKEN_BACKENDS = PLAIN_TOKEN_BACKENDS | PAGE_BACKENDS


def layout_of(impl: Any, isa: Any, cache: torch.Tensor) -> dict[str, Any]:
    """What a page of a layer's cache holds: the attention backend, its CPU instruction set
    (which decides the packing inside a CPU page) and the page shape."""
    return {
        "backend": type(impl).__name__ if impl is not None else "",
        "isa": isa,
        "page": list(cache.shape[1:]),
        "dtype": str(cache.dtype).removeprefix("torch."),
    }


def clear_cuda_error(cudart: Any) -> bool:
    """Reset CUDA's last error after a failed runtime call, so the next kernel launch
    check does not report it as its own. Through torch's runtime binding when it has
    ``cudaGetLastError``, else through the runtime library this process loaded (ctypes).
    Whether it was cleared."""
    get_last = getattr(cudart, "cudaGetLastError", None)
    if get_last is None:
        library = _loaded_cudart()
        if library is None:
            return False
        get_last = library.cudaGetLastError
    get_last()
    return True


def _loaded_cudart() -> Any:
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcudart.so" in os.path.basename(path):
                return ctypes.CDLL(path)
    return None


@dataclass
class _Save:
    """One transfer's copies: in flight, landed, or failed."""

    op: StoreOp
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    fmt: str = ""
    layout: dict[str, Any] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)  # device buffers the copies read
    done: Any = None  # the step's completion event (CUDA); None: copies are complete
    error: str | None = None
    cancelled: bool = False
    settled: bool = False  # published or discarded


class Saver:
    """The producer's arena and the saves into it."""

    def __init__(self, engine: Engine, tally: shm.Tally) -> None:
        self._engine = engine
        self._cfg = engine.cfg
        self._tally = tally
        self.rank = 0
        self.arena: shm.Arena | None = None
        self.arena_t: torch.Tensor | None = None
        self.registered = False
        self.unregistered: str | None = None  # why copies cannot go into the arena
        self._ready = False  # the owner record says all the scheduler needs
        self._stream: Any = None
        self._caches: dict[str, torch.Tensor] = {}
        self._layout: Callable[[str, torch.Tensor], dict[str, Any]] = lambda n, c: {}
        self.saves: dict[str, _Save] = {}  # req id -> copies in flight or landed

    # -- the arena

    def open(
        self,
        caches: dict[str, torch.Tensor],
        layout: Callable[[str, torch.Tensor], dict[str, Any]],
        rank: int,
    ) -> None:
        """Own the arena (on CUDA, registered); ``layout`` tells a layer's layout (from the
        attention layers known at start, else from the step's forward context)."""
        self._caches, self._layout, self.rank = caches, layout, rank
        first = next(iter(caches.values()), None)
        if not self._cfg.arena_bytes or first is None:
            return
        path = os.path.join(self._cfg.shm_dir, self._engine.arena_file(rank))
        self.arena = shm.create_arena(path, self._cfg.arena_bytes, owner=self._owner())
        self.arena_t = torch.frombuffer(self.arena.buffer, dtype=torch.uint8)
        if first.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=first.device)
            self.register(torch.cuda.cudart())
        self._ready = True
        shm.arena.write_owner(self.arena.path, self._owner())

    def _owner(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "engine_id": self._cfg.engine_id,
            "dp_rank": self._engine.dp_rank,
            "rank": self.rank,
            # None on the CPU (nothing to register)
            "host_registered": False if self.unregistered else (self.registered or None),
            "fallback": self.unregistered,
            "ready": self._ready,
        }

    def register(self, cudart: Any) -> None:
        """Register the arena with CUDA, so copies into it are DMA. A failure clears the
        CUDA error and sends every prefill the counted fallback: a copy into pageable
        memory would block the host inside the step. One log line says so."""
        assert self.arena is not None and self.arena_t is not None
        err = cudart.cudaHostRegister(self.arena_t.data_ptr(), self._cfg.arena_bytes, 0)
        code = int(getattr(err, "value", err))
        if code == 0:
            self.registered = True
            shm.arena.write_owner(self.arena.path, self._owner())
            return
        cleared = clear_cuda_error(cudart)
        self.unregistered = (
            f"cudaHostRegister of the KV arena failed (CUDA error {code}): every prefill "
            "falls back (decoded where it was prefilled) rather than copy into pageable memory"
        )
        shm.arena.write_owner(self.arena.path, self._owner())
        logger.error(
            "SyshaxShmConnector %s: %s; the CUDA error was %s",
            self._cfg.engine_id,
            self.unregistered,
            "cleared" if cleared else "NOT cleared (no runtime library found to clear it)",
        )

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        if self.registered and self.arena_t is not None:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.arena_t.data_ptr())
            self.registered = False
        if self.arena is not None:
            self.arena_t = None
            self.arena.close(unlink=True)  # its transfers end with this engine
            self.arena = None

    # -- the step's saves

    def gather(self, meta: Any) -> None:
        """Gather every store of the step (``meta``) not gathered yet, all layers, into the
        arena; on CUDA start the copies and record one completion event. Never waits."""
        if not isinstance(meta, SyshaxShmMetadata) or not meta.stores:
            return
        batch = []
        for op in meta.stores:
            if op.request_id in self.saves:
                continue
            save = self.saves[op.request_id] = _Save(op)
            try:
                self._lay_out(save)
                batch.append(save)
            except Exception as exc:  # the engine goes on; the segment names the failure
                if engine_broken(exc):
                    raise
                self._failed(save, cause(exc))
        if not batch:
            return
        try:
            if self._stream is not None:
                self._gather_cuda(batch)
            else:
                self._gather_host(batch)
        except Exception as exc:
            if engine_broken(exc):
                raise
            for save in batch:
                self._failed(save, cause(exc))

    def _failed(self, save: _Save, why: str) -> None:
        save.error = why
        logger.error(
            "SyshaxShmConnector %s: copying transfer %s failed (%s, %d so far): %s",
            self._cfg.engine_id,
            save.op.transfer_id,
            shm.Cause.SAVE_FAILED.value,
            self._tally.add(shm.Cause.SAVE_FAILED),
            why,
        )

    def _lay_out(self, save: _Save) -> None:
        """Where each layer of ``save`` lies in its run, and in which format."""
        if self.arena_t is None:
            raise RuntimeError("this engine has no arena")
        if self.unregistered is not None:
            raise RuntimeError(self.unregistered)
        op, slab = save.op, self._cfg.slab_bytes
        offset, end = op.run.offset(slab), op.run.offset(slab) + op.run.length(slab)
        for name, cache in self._caches.items():
            layout = self._layout(name, cache)
            if layout["backend"] in PLAIN_TOKEN_BACKENDS:
                shape = [2, op.num_tokens, cache.shape[1], cache.shape[3] // 2]
                save.fmt = "tokens"
            else:
                shape = [-(-op.num_tokens // self._engine.block_size), *cache.shape[1:]]
                save.fmt = "pages"
            nbytes = math.prod(shape) * cache.element_size()
            if offset + nbytes > end:
                raise RuntimeError(f"the run of {op.run.count} slabs is too small for the transfer")
            save.layout = layout
            save.layers[name] = {
                "offset": offset,
                "nbytes": nbytes,
                "shape": shape,
                "dtype": str(cache.dtype).removeprefix("torch."),
            }
            offset += shm.align_up(nbytes)

    def _dst(self, save: _Save, name: str, dtype: torch.dtype) -> torch.Tensor:
        piece = save.layers[name]
        assert self.arena_t is not None
        raw = self.arena_t[piece["offset"] : piece["offset"] + piece["nbytes"]]
        return raw.view(dtype).view(piece["shape"])

    def _index(self, batch: list[_Save], device: torch.device) -> tuple[Any, list[int]]:
        """The step's one gather index (blocks for pages, (block, offset) for tokens) and
        where each save's rows start in what it gathers."""
        starts, rows, pages = [0], [], batch[0].fmt == "pages"
        bs = self._engine.block_size
        for save in batch:
            op = save.op
            if pages:
                used = -(-op.num_tokens // bs)
                rows.append(torch.tensor(op.block_ids[:used], dtype=torch.long))
            else:
                positions = torch.arange(0, op.num_tokens)
                blocks = torch.tensor(op.block_ids, dtype=torch.long)
                rows.append(blocks[positions // bs] * bs + positions % bs)
            starts.append(starts[-1] + len(rows[-1]))
        index = _on(torch.cat(rows), device)
        if pages:
            return index, starts
        kernel_block = next(iter(self._caches.values())).shape[2]
        return (index // kernel_block, index % kernel_block), starts

    def _gather_host(self, batch: list[_Save]) -> None:
        """On the CPU: straight into the arena, layer by layer."""
        for fmt in ("pages", "tokens"):
            group = [s for s in batch if s.fmt == fmt]
            if not group:
                continue
            index, starts = self._index(group, torch.device("cpu"))
            for name, cache in self._caches.items():
                if fmt == "pages":
                    for i, save in enumerate(group):
                        rows = index[starts[i] : starts[i + 1]]
                        torch.index_select(cache, 0, rows, out=self._dst(save, name, cache.dtype))
                    continue
                tokens = cache[index[0], :, index[1]]  # one gather for the step's stores
                t, heads, width = tokens.shape
                halves = tokens.view(t, heads, 2, width // 2)
                for i, save in enumerate(group):
                    piece = halves[starts[i] : starts[i + 1]].permute(2, 0, 1, 3)
                    self._dst(save, name, cache.dtype).copy_(piece)

    def _gather_cuda(self, batch: list[_Save]) -> None:
        """On CUDA: per layer, one gather of the step's stores on the compute stream into a
        staging buffer, then the side stream's copies into the arena once it is written. At
        most ``staging_mib`` of buffers: the compute stream waits on the device for a
        buffer's copies before it gathers into it again. One event after the last copy."""
        first = next(iter(self._caches.values()))
        device, compute, side = first.device, torch.cuda.current_stream(first.device), self._stream
        fmts = {s.fmt for s in batch}
        if len(fmts) != 1:
            raise RuntimeError(f"layers of several formats {sorted(fmts)} in one engine")
        index, starts = self._index(batch, device)
        pages = batch[0].fmt == "pages"
        rows = starts[-1]
        shapes = {
            name: [rows, *cache.shape[1:]]
            if pages
            else [2, rows, cache.shape[1], cache.shape[3] // 2]
            for name, cache in self._caches.items()
        }
        largest = max(
            math.prod(shapes[name]) * cache.element_size() for name, cache in self._caches.items()
        )
        # How many staging buffers the step cycles through: all its layers when they fit.
        budget = max(2, min(len(self._caches), self._cfg.staging_bytes // max(1, largest)))
        slots: list[torch.Tensor] = []
        held: list[torch.Tensor] = []  # every buffer a copy of this step reads
        freed: list[Any] = []
        for i, (name, cache) in enumerate(self._caches.items()):
            shape = shapes[name]
            k = i % budget
            if k >= len(slots):
                slots.append(torch.empty(shape, dtype=cache.dtype, device=device))
                held.append(slots[k])
                freed.append(None)
            elif freed[k] is not None:
                compute.wait_event(freed[k])  # its last copies have read it: on the device
            buf = slots[k]
            if buf.shape != torch.Size(shape) or buf.dtype != cache.dtype:  # a draft's layer
                buf = slots[k] = torch.empty(shape, dtype=cache.dtype, device=device)
                held.append(buf)
            if pages:
                torch.index_select(cache, 0, index, out=buf)
            else:
                tokens = cache[index[0], :, index[1]]
                t, heads, width = tokens.shape
                buf.copy_(tokens.view(t, heads, 2, width // 2).permute(2, 0, 1, 3))
            ready = torch.cuda.Event()
            ready.record(compute)
            with torch.cuda.stream(side):
                side.wait_event(ready)
                for j, save in enumerate(batch):
                    dst, a, b = self._dst(save, name, cache.dtype), starts[j], starts[j + 1]
                    if pages:
                        dst.copy_(buf[a:b], non_blocking=True)
                    else:
                        dst[0].copy_(buf[0, a:b], non_blocking=True)
                        dst[1].copy_(buf[1, a:b], non_blocking=True)
                freed[k] = torch.cuda.Event()
                freed[k].record(side)
        done = torch.cuda.Event()
        done.record(side)  # after the step's last copy, every layer's (a draft model's too)
        for save in batch:
            save.done, save.keep = done, held  # the buffers live until the copies land

    # -- publication

    def settle(self, save: _Save, ipc_ns: str) -> None:
        """Publish a transfer whose copies have landed, or discard it."""
        op, cfg = save.op, self._cfg
        save.keep = []
        save.done = None
        if save.cancelled:
            self.discard(op)
            return
        header = {
            **shm.segment_header(
                op.transfer_id,
                self.rank,
                engine_id=cfg.engine_id,
                arena_file=self._engine.arena_file(self.rank),
                run=op.run,
                slab_bytes=cfg.slab_bytes,
                num_tokens=op.num_tokens,
                expires_at=op.expires_at,
            ),
            "ipc_namespace": ipc_ns,
            "format": save.fmt,
            "layout": save.layout,
            "layers": {
                name: {k: v for k, v in piece.items() if k != "nbytes"}
                for name, piece in save.layers.items()
            },
        }
        if save.error is not None or set(save.layers) != set(self._caches):
            header["error"] = save.error or "not every layer was copied"
        base = os.path.join(cfg.shm_dir, shm.segment_name(op.transfer_id, self.rank, op.expires_at))
        try:
            # A .tmp the reaper removed (its lease over) stays gone: nothing is published.
            # The write sets the file's mtime: the lease counts from this publication.
            shm.write_file(base + ".tmp", shm.encode_header(header), create=False)
            os.rename(base + ".tmp", base)
        except OSError as exc:
            logger.warning(
                "SyshaxShmConnector %s: transfer %s not published: %s",
                cfg.engine_id,
                op.transfer_id,
                exc,
            )

    def discard(self, op: StoreOp) -> None:
        base = os.path.join(
            self._cfg.shm_dir, shm.segment_name(op.transfer_id, self.rank, op.expires_at)
        )
        for path in (base + ".tmp", base):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small index tensor on ``device``: on CUDA through pinned memory and a copy queued
    on the compute stream, so the host thread never waits for the device."""
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)
