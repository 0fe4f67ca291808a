"""The worker side of SyshaxShmConnector: the copies into the producer's arena and out of it
into the consumer's paged cache (docs/kv-connector.md).

An exception in the copies of one transfer fails that transfer alone: a save publishes its
segment with the error (its decode recomputes), a load is reported failed (vLLM recomputes
the prompt), with the cause logged. Only an exception that says the engine itself is broken
(``engine_broken``: host memory, a CUDA error) goes through to vLLM."""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import syshax_kv_shm as shm
import torch
from syshax_kv_plan import Engine, LoadOp, StoreOp, SyshaxShmMetadata, cause, engine_broken
from vllm.logger import init_logger

logger = init_logger("vllm.syshax_kv_connector")
SegmentError = shm.SegmentError
# Attention backends whose page view holds each token's K|V as one row (vLLM 0.32's CUDA
# backends): they write and read the per-token segment format.
PLAIN_TOKEN_BACKENDS = frozenset({"FlashAttentionImpl", "TritonAttentionImpl"})


@dataclass
class _Save:
    """Worker side: one transfer's copies in flight."""

    op: StoreOp
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    fmt: str = ""
    layout: dict[str, Any] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)  # device sources of pending copies
    done: Any = None  # the side stream's completion event (CUDA); None: copies are complete
    error: str | None = None
    cancelled: bool = False
    settled: bool = False  # published or discarded
    index: tuple[torch.Tensor, ...] | None = None


class Copier:
    """The worker-side hooks of the connector."""

    def __init__(self, engine: Engine) -> None:
        self._cfg = engine.cfg
        self._engine_id = engine.cfg.engine_id
        self._block_size = engine.block_size
        self._ipc_ns = engine.ipc_ns
        # One token's keys (and values) in this engine's cache: [heads on this rank, size].
        self._token_shape = (
            int(engine.geometry["kv_heads"]) // max(1, engine.tp),
            int(engine.geometry["head_size"]),
        )
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, dict[str, Any]] = {}
        self._rank = 0
        self._arena: shm.Arena | None = None  # the producer's
        self._arena_t: torch.Tensor | None = None
        self._arena_registered = False
        self._stream: Any = None
        self._saves: dict[str, _Save] = {}  # req id -> copies in flight or landed
        self._told_finished: set[str] = set()
        self._waiting_loads: dict[str, LoadOp] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._views: dict[str, shm.ArenaView] = {}

    def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        if self._arena_registered and self._arena_t is not None:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._arena_t.data_ptr())
            self._arena_registered = False
        if self._arena is not None:
            self._arena_t = None
            self._arena.close(unlink=True)  # its transfers end with this engine
            self._arena = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
        except (AssertionError, ImportError, RuntimeError):
            self._rank = 0
        first = next(iter(kv_caches.values()), None)
        if self._cfg.arena_bytes and first is not None:
            self._open_arena(first.device)
        logger.info(
            "SyshaxShmConnector %s: %d KV layers, layer view %s %s on %s, rank %d, arena %s",
            self._engine_id,
            len(kv_caches),
            tuple(first.shape) if first is not None else None,
            first.dtype if first is not None else None,
            first.device if first is not None else None,
            self._rank,
            "registered with CUDA"
            if self._arena_registered
            else ("mapped" if self._arena_t is not None else "none (decode only)"),
        )

    def _open_arena(self, device: torch.device) -> None:
        path = os.path.join(self._cfg.shm_dir, shm.arena_name(self._engine_id, self._rank))
        self._arena = shm.create_arena(path, self._cfg.arena_bytes)
        self._arena_t = torch.frombuffer(self._arena.buffer, dtype=torch.uint8)
        if device.type != "cuda":
            return
        self._stream = torch.cuda.Stream(device=device)
        err = torch.cuda.cudart().cudaHostRegister(
            self._arena_t.data_ptr(), self._cfg.arena_bytes, 0
        )
        code = int(getattr(err, "value", err))
        if code == 0:
            self._arena_registered = True
        else:
            logger.warning(
                "SyshaxShmConnector %s: cudaHostRegister of the arena failed (error %d): "
                "copies into it are pageable and slow",
                self._engine_id,
                code,
            )

    def _layout(self, layer_name: str, cache: torch.Tensor, context: Any = None) -> dict[str, Any]:
        """What a page of this engine's cache holds: the attention backend, its CPU
        instruction set (which decides the packing inside a CPU page) and the page shape."""
        known = self._layouts.get(layer_name)
        if known is not None:
            return known
        layer = None
        if context is not None:
            layer = getattr(context, "no_compile_layers", {}).get(layer_name)
        if layer is None:
            from vllm.forward_context import get_forward_context

            with contextlib.suppress(AssertionError, AttributeError, RuntimeError):
                layer = get_forward_context().no_compile_layers.get(layer_name)
        impl = getattr(layer, "impl", None)
        layout = {
            "backend": type(impl).__name__ if impl is not None else "",
            "isa": getattr(layer, "isa", None),
            "page": list(cache.shape[1:]),
            "dtype": str(cache.dtype).removeprefix("torch."),
        }
        if layer is not None:
            self._layouts[layer_name] = layout
        return layout

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)
        return blocks[positions // self._block_size] * self._block_size + (
            positions % self._block_size
        )

    def save_kv_layer(self, meta: Any, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Start this layer's copies of the step's stores (``meta``): never wait for them."""
        if not isinstance(meta, SyshaxShmMetadata) or not meta.stores:
            return
        for op in meta.stores:
            save = self._saves.get(op.request_id)
            if save is None:
                save = self._saves[op.request_id] = _Save(op)
            if save.error is not None:
                continue
            try:
                self._save_layer(save, layer_name, kv_layer)
            except Exception as exc:  # the engine goes on; the segment names the failure
                if engine_broken(exc):
                    raise
                save.error = f"layer {layer_name}: {cause(exc)}"
                logger.error(
                    "SyshaxShmConnector %s: copying transfer %s failed: %s",
                    self._engine_id,
                    op.transfer_id,
                    save.error,
                )

    def _save_layer(self, save: _Save, layer_name: str, kv_layer: torch.Tensor) -> None:
        op = save.op
        if self._arena_t is None:
            raise RuntimeError("this engine has no arena")
        layout = self._layout(layer_name, kv_layer)
        cuda = kv_layer.device.type == "cuda"
        if layout["backend"] in PLAIN_TOKEN_BACKENDS:
            # Per-token K|V rows: canonical [2, tokens, heads, head_size], K then V.
            if save.index is None:
                slots = _on(self._slots(op.block_ids, 0, op.num_tokens), kv_layer.device)
                kernel_block = kv_layer.shape[2]
                save.index = (slots // kernel_block, slots % kernel_block)
            rows = kv_layer[save.index[0], :, save.index[1]]
            tokens, heads, width = rows.shape
            shape = [2, tokens, heads, width // 2]
            fmt = "tokens"
        else:
            # Packed pages (the CPU backend): copied whole, for a consumer of the same
            # backend and instruction set.
            used = -(-op.num_tokens // self._block_size)
            if save.index is None:
                save.index = (
                    _on(torch.tensor(op.block_ids[:used], dtype=torch.long), kv_layer.device),
                )
            shape = [used, *kv_layer.shape[1:]]
            fmt = "pages"
        offset = op.run.offset(self._cfg.slab_bytes) + sum(
            shm.align_up(p["nbytes"]) for p in save.layers.values()
        )
        nbytes = math.prod(shape) * kv_layer.element_size()
        if offset + nbytes > op.run.offset(self._cfg.slab_bytes) + op.run.length(
            self._cfg.slab_bytes
        ):
            raise RuntimeError(f"the run of {op.run.count} slabs is too small for the transfer")
        dst = self._arena_t[offset : offset + nbytes].view(kv_layer.dtype).view(shape)
        if fmt == "tokens":
            data = rows.view(tokens, heads, 2, width // 2).permute(2, 0, 1, 3).contiguous()
        if cuda:
            if fmt == "pages":
                data = torch.index_select(kv_layer, 0, save.index[0])
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kv_layer.device))
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                dst.copy_(data, non_blocking=True)
            save.keep.append(data)  # freed only once the side stream has read it
        elif fmt == "pages":
            torch.index_select(kv_layer, 0, save.index[0], out=dst)
        else:
            dst.copy_(data)
        save.fmt, save.layout = fmt, layout
        save.layers[layer_name] = {
            "offset": offset,
            "nbytes": nbytes,
            "shape": shape,
            "dtype": str(kv_layer.dtype).removeprefix("torch."),
        }

    def wait_for_save(self) -> None:
        """Record when this step's copies land; never wait for them."""
        for save in self._saves.values():
            if save.keep and save.done is None and self._stream is not None:
                save.done = torch.cuda.Event()
                save.done.record(self._stream)

    def get_transfer_results(
        self, meta: Any, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(sent, received, failed to receive): requests whose copies landed and that the
        scheduler has finished, loads done (failed ones included), loads that failed."""
        if isinstance(meta, SyshaxShmMetadata):
            for op in meta.stores:
                if op.request_id not in self._saves:
                    # save_kv_layer never ran for it: the segment says so, the blocks go back.
                    self._saves[op.request_id] = _Save(op, error="no layer was saved")
            cancelled = set(meta.cancels)
            for save in self._saves.values():
                if save.op.transfer_id in cancelled:
                    save.cancelled = True
                    if save.settled:  # published before the scheduler knew: take it back
                        self._discard(save.op)
        self.wait_for_save()  # when finalising is deferred, this step's copies still count
        self._told_finished |= finished_req_ids & self._saves.keys()
        for rid in finished_req_ids & self._waiting_loads.keys():
            # The decode was aborted while it waited: its blocks are freed once reported.
            op = self._waiting_loads.pop(rid)
            shm.unlink_transfer(self._cfg.shm_dir, op.transfer_id, op.ranks, op.expires_at)
            self._recv_done.add(rid)
        sending = set()
        for rid, save in list(self._saves.items()):
            if save.done is not None and not save.done.query():
                continue  # still copying
            if not save.settled:
                try:
                    self._settle(save)
                except Exception as exc:  # not published: its decode finds it gone
                    if engine_broken(exc):
                        raise
                    logger.error(
                        "SyshaxShmConnector %s: transfer %s discarded: %s",
                        self._engine_id,
                        save.op.transfer_id,
                        cause(exc),
                    )
                    self._discard(save.op)
                save.settled = True
            if rid in self._told_finished:
                sending.add(rid)
                del self._saves[rid]
                self._told_finished.discard(rid)
        received, failed = self._recv_done | self._recv_failed, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return sending, received, failed

    def _discard(self, op: StoreOp) -> None:
        base = os.path.join(
            self._cfg.shm_dir, shm.segment_name(op.transfer_id, self._rank, op.expires_at)
        )
        for path in (base + ".tmp", base):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _settle(self, save: _Save) -> None:
        """Publish a transfer whose copies have landed, or discard it."""
        op, cfg = save.op, self._cfg
        save.keep.clear()
        save.done = None
        if save.cancelled:
            self._discard(op)
            return
        header = {
            **shm.segment_header(
                op.transfer_id,
                self._rank,
                engine_id=self._engine_id,
                run=op.run,
                slab_bytes=cfg.slab_bytes,
                num_tokens=op.num_tokens,
                expires_at=op.expires_at,
            ),
            "ipc_namespace": self._ipc_ns,
            "format": save.fmt,
            "layout": save.layout,
            "layers": {
                name: {k: v for k, v in piece.items() if k != "nbytes"}
                for name, piece in save.layers.items()
            },
        }
        if save.error is not None or set(save.layers) != set(self._kv_caches):
            header["error"] = save.error or "not every layer was copied"
        base = os.path.join(
            cfg.shm_dir, shm.segment_name(op.transfer_id, self._rank, op.expires_at)
        )
        try:
            # A .tmp the reaper removed (its lease over) stays gone: nothing is published.
            shm.write_file(base + ".tmp", shm.encode_header(header), create=False)
            os.rename(base + ".tmp", base)
        except OSError as exc:
            logger.warning(
                "SyshaxShmConnector %s: transfer %s not published: %s",
                self._engine_id,
                op.transfer_id,
                exc,
            )

    def start_load_kv(self, meta: Any, forward_context: Any) -> None:
        """Load every waiting transfer whose segment is published (``meta`` adds new ones)."""
        if isinstance(meta, SyshaxShmMetadata):
            for op in meta.loads:
                self._waiting_loads[op.request_id] = op
        for rid, op in list(self._waiting_loads.items()):
            started = time.perf_counter()
            try:
                if op.error is not None:
                    raise SegmentError(op.error)
                if not self._claim_when_ready(op):
                    continue
                self._load(op, forward_context)
            except Exception as exc:  # reported failed: vLLM recomputes the prompt
                if engine_broken(exc):
                    raise
                logger.error(
                    "SyshaxShmConnector %s: request %s cannot load transfer %s, it recomputes "
                    "its prompt: %s",
                    self._engine_id,
                    rid,
                    op.transfer_id,
                    cause(exc),
                )
                self._recv_failed.add(rid)
            else:
                self._recv_done.add(rid)
                logger.info(
                    "SyshaxShmConnector %s: request %s loaded %d tokens of transfer %s in %.1f ms",
                    self._engine_id,
                    rid,
                    op.end - op.start,
                    op.transfer_id,
                    1000 * (time.perf_counter() - started),
                )
            # Loaded or not, the transfer is over: its files go, so its run comes back.
            del self._waiting_loads[rid]
            shm.unlink_transfer(self._cfg.shm_dir, op.transfer_id, op.ranks, op.expires_at)

    def _claim_when_ready(self, op: LoadOp) -> bool:
        """Claim every rank's segment once all are published; False while a copy is still
        under way. Raises SegmentError when the transfer can no longer arrive."""
        cfg = self._cfg
        bases = [
            os.path.join(cfg.shm_dir, shm.segment_name(op.transfer_id, r, op.expires_at))
            for r in range(op.ranks)
        ]
        for base in bases:
            if os.path.exists(base):
                continue
            if os.path.exists(base + ".tmp"):
                if time.time() > op.expires_at:
                    raise SegmentError(
                        "the producer's copy had not landed when the lease ended "
                        f"({cfg.lease_seconds:.0f}s)"
                    )
                return False
            raise SegmentError(
                f"segment {os.path.basename(base)} vanished before loading (its lease ended, "
                "or the producer discarded it)"
            )
        if time.time() > op.expires_at:
            raise SegmentError("its lease ended before the load (the reaper may free it now)")
        for base in bases:
            try:
                os.rename(base, base + ".claimed")
                os.utime(base + ".claimed")  # the claim's time, which the reaper counts from
            except FileNotFoundError:
                raise SegmentError(f"segment {os.path.basename(base)} vanished") from None
        return True

    def _arena_view(self, name: str) -> shm.ArenaView:
        path = os.path.join(self._cfg.shm_dir, name)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise SegmentError(f"the producer's arena {name} is gone") from None
        view = self._views.get(path)
        if view is None or view.inode != stat.st_ino or view.size != stat.st_size:
            if view is not None:
                with contextlib.suppress(BufferError):
                    view.buffer.close()
            view = self._views[path] = shm.open_arena(path)
        return view

    def _sources(self, op: LoadOp) -> tuple[str, dict[str, Any], list[dict[str, torch.Tensor]]]:
        """Each rank's layers as tensors over the producer's arena (no copy), checked."""
        names = list(self._kv_caches)
        parts: list[dict[str, torch.Tensor]] = []
        fmt, layout = "", {}
        for rank in range(op.ranks):
            path = os.path.join(
                self._cfg.shm_dir, shm.segment_name(op.transfer_id, rank, op.expires_at)
            )
            header = shm.read_header(path + ".claimed")
            arena = header.get("arena")
            if not isinstance(arena, str) or not shm.ARENA_RE.fullmatch(arena):
                raise SegmentError(f"segment names no arena of ours: {shm.show(arena, 100)}")
            view = self._arena_view(arena)
            pieces = shm.check_segment(
                header,
                arena_size=view.size,
                layers=names,
                transfer_id=op.transfer_id,
                rank=rank,
            )
            fmt, layout = header["format"], dict(header.get("layout") or {})
            tensors = {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only mapping, read only
                for name, piece in pieces.items():
                    raw = torch.frombuffer(
                        view.buffer, dtype=torch.uint8, count=piece.nbytes, offset=piece.offset
                    )
                    tensors[name] = raw.view(getattr(torch, piece.dtype)).view(piece.shape)
            parts.append(tensors)
        return fmt, layout, parts

    def _load(self, op: LoadOp, context: Any) -> None:
        fmt, theirs, parts = self._sources(op)
        for layer_name, cache in self._kv_caches.items():
            ranks = [p[layer_name] for p in parts]
            if fmt == "pages":
                src = ranks[0] if len(ranks) == 1 else torch.cat(ranks, dim=1)
                mine = self._layout(layer_name, cache, context)
                theirs = {**theirs, "page": [src.shape[1], *list(theirs.get("page") or [])[1:]]}
                if mine != theirs:
                    raise SegmentError(
                        f"the producer's KV pages ({theirs}) are not this engine's ({mine}); "
                        "a page copy needs the same attention backend and instruction set"
                    )
                first = op.start // self._block_size
                last = -(-op.end // self._block_size)
                if last > src.shape[0] or last > len(op.block_ids):
                    raise SegmentError(f"the segment holds {src.shape[0]} pages, {last} needed")
                dst = torch.tensor(op.block_ids[first:last], dtype=torch.long)
                cache.index_copy_(0, dst.to(cache.device), src[first:last].to(cache.device))
            elif fmt == "tokens":
                self._check_tokens(layer_name, ranks, op.end)
                key = torch.cat([r[0, op.start : op.end] for r in ranks], dim=1)
                value = torch.cat([r[1, op.start : op.end] for r in ranks], dim=1)
                self._write_tokens(layer_name, cache, key, value, op, context)
        for rank in range(op.ranks):
            name = shm.segment_name(op.transfer_id, rank, op.expires_at) + ".claimed"
            if not os.path.exists(os.path.join(self._cfg.shm_dir, name)):
                raise SegmentError(f"{name} was reaped during the load: its pages may be reused")

    def _check_tokens(self, layer_name: str, ranks: list[torch.Tensor], end: int) -> None:
        """Each rank's ``[2, tokens, heads, head_size]`` against this engine's cache, before
        any byte reaches a kernel that trusts its shapes (the CPU backend's writer)."""
        heads, size = self._token_shape
        shapes = [tuple(r.shape) for r in ranks]
        if (
            any(len(s) != 4 or s[0] != 2 or s[1] < end or s[3] != size for s in shapes)
            or sum(s[2] for s in shapes) != heads
        ):
            raise SegmentError(
                f"layer {layer_name}: the segment's tokens {shapes} are not [2, >= {end} "
                f"tokens, {heads} heads in all, {size}] as this engine's cache holds them"
            )

    def _write_tokens(
        self,
        layer_name: str,
        cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        op: LoadOp,
        context: Any,
    ) -> None:
        """``[tokens, heads, head_size]`` keys and values into this engine's pages."""
        slots = self._slots(op.block_ids, op.start, op.end).to(cache.device)
        key = key.to(cache.device, dtype=cache.dtype)
        value = value.to(cache.device, dtype=cache.dtype)
        layout = self._layout(layer_name, cache, context)
        if layout["backend"] in PLAIN_TOKEN_BACKENDS:
            kernel_block = cache.shape[2]
            cache[slots // kernel_block, :, slots % kernel_block] = torch.cat((key, value), -1)
            return
        if layout["backend"] == "CPUAttentionBackendImpl":
            # The CPU backend packs keys per instruction set: write through its own op.
            from vllm import _custom_ops as ops

            blocks, heads, block_size, _ = cache.shape
            halves = cache.view(blocks, heads, block_size * 2, -1)
            key_cache, value_cache = halves.chunk(2, dim=2)
            layer = context.no_compile_layers.get(layer_name)
            ops.cpu_attn_reshape_and_cache(
                key,
                value,
                key_cache,
                value_cache,
                slots,
                layout["isa"],
                k_scale=getattr(layer, "_k_scale_float", 1.0),
                v_scale=getattr(layer, "_v_scale_float", 1.0),
            )
            return
        raise SegmentError(f"no token writer for attention backend {layout['backend']!r}")


def _on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small index tensor on ``device``: on CUDA through pinned memory and a copy queued
    on the compute stream, so the forward's host thread never waits for the device."""
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)
