"""The worker side of SyshaxShmConnector: the hooks, the loads out of a producer's arena
into the consumer's paged cache; the saves into this engine's own arena are the
:class:`~syshax_kv_save.Saver`'s (docs/kv-connector.md).

An exception in the copies of one transfer fails that transfer alone: a save publishes its
segment with the error (its decode recomputes), a load is reported failed (vLLM recomputes
the prompt), with the cause logged. Only an exception that says the engine itself is broken
(``engine_broken``: host memory, a CUDA error) goes through to vLLM."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import Any

import syshax_kv_shm as shm
import torch
from syshax_kv_plan import Engine, LoadOp, SyshaxShmMetadata, cause, engine_broken
from syshax_kv_save import PLAIN_TOKEN_BACKENDS, SPOKEN_BACKENDS, Saver, layout_of
from vllm.logger import init_logger

logger = init_logger("vllm.syshax_kv_connector")
SegmentError = shm.SegmentError


class Copier:
    """The worker-side hooks of the connector."""

    def __init__(self, engine: Engine) -> None:
        self._cfg = engine.cfg
        self._engine_id = engine.cfg.engine_id
        self._block_size = engine.block_size
        self._ipc_ns = engine.ipc_ns
        self.tally = shm.Tally()
        self.saver = Saver(engine, self.tally)
        # One token's keys (and values) in this engine's cache: [heads on this rank, size].
        self._token_shape = (
            int(engine.geometry["kv_heads"]) // max(1, engine.tp),
            int(engine.geometry["head_size"]),
        )
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, dict[str, Any]] = {}
        self._told_finished: set[str] = set()
        self._waiting_loads: dict[str, LoadOp] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._views: dict[str, shm.ArenaView] = {}

    @property
    def _arena(self) -> shm.Arena | None:
        return self.saver.arena

    def shutdown(self) -> None:
        self.saver.close()

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], layers: dict[str, Any] | None = None
    ) -> None:
        """The engine's caches, with its attention layers (vLLM's static forward context)
        when known: a backend whose layout this connector does not speak stops the engine
        here, naming it, rather than recompute every decode."""
        self._kv_caches = dict(kv_caches)
        rank = 0
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except (AssertionError, ImportError, RuntimeError):
            rank = 0
        for name, cache in kv_caches.items():
            layer = (layers or {}).get(name)
            if layer is None:
                continue
            layout = layout_of(getattr(layer, "impl", None), getattr(layer, "isa", None), cache)
            if layout["backend"] not in SPOKEN_BACKENDS:
                raise ValueError(
                    f"SyshaxShmConnector does not speak the KV layout of attention backend "
                    f"{layout['backend']!r} (layer {name}); it speaks "
                    f"{', '.join(sorted(SPOKEN_BACKENDS))}: choose one of those "
                    "(--attention-backend / VLLM_ATTENTION_BACKEND) or drop the connector"
                )
            self._layouts[name] = layout
        first = next(iter(kv_caches.values()), None)
        self.saver.open(self._kv_caches, self._layout, rank)
        logger.info(
            "SyshaxShmConnector %s: %d KV layers, layer view %s %s on %s, rank %d, arena %s",
            self._engine_id,
            len(kv_caches),
            tuple(first.shape) if first is not None else None,
            first.dtype if first is not None else None,
            first.device if first is not None else None,
            rank,
            "registered with CUDA"
            if self.saver.registered
            else (
                "mapped"
                if self.saver.arena_t is not None and self.saver.unregistered is None
                else (self.saver.unregistered or "none (decode only)")
            ),
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
        layout = layout_of(getattr(layer, "impl", None), getattr(layer, "isa", None), cache)
        if layer is not None:
            self._layouts[layer_name] = layout
        return layout

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)
        return blocks[positions // self._block_size] * self._block_size + (
            positions % self._block_size
        )

    def wait_for_save(self, meta: Any) -> None:
        """Gather the step's stores (``meta``) and start their copies; never wait."""
        self.saver.gather(meta)

    def get_transfer_results(
        self, meta: Any, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(sent, received, failed to receive): requests whose copies landed and that the
        scheduler has finished, loads done (failed ones included), loads that failed."""
        saves = self.saver.saves
        # When finalising is deferred, this step's stores still count (an idempotent call).
        self.saver.gather(meta)
        if isinstance(meta, SyshaxShmMetadata):
            cancelled = set(meta.cancels)
            for save in saves.values():
                if save.op.transfer_id in cancelled:
                    save.cancelled = True
                    if save.settled:  # published before the scheduler knew: take it back
                        self.saver.discard(save.op)
        self._told_finished |= finished_req_ids & saves.keys()
        for rid in finished_req_ids & self._waiting_loads.keys():
            # The decode was aborted while it waited: its blocks are freed once reported.
            op = self._waiting_loads.pop(rid)
            shm.unlink_transfer(self._cfg.shm_dir, op.transfer_id, op.ranks, op.expires_at)
            self._recv_done.add(rid)
        sending = set()
        for rid, save in list(saves.items()):
            if save.done is not None and not save.done.query():
                continue  # still copying
            if not save.settled:
                try:
                    self.saver.settle(save, self._ipc_ns)
                except Exception as exc:  # not published: its decode finds it gone
                    if engine_broken(exc):
                        raise
                    logger.error(
                        "SyshaxShmConnector %s: transfer %s discarded: %s",
                        self._engine_id,
                        save.op.transfer_id,
                        cause(exc),
                    )
                    self.saver.discard(save.op)
                save.settled = True
            if rid in self._told_finished:
                sending.add(rid)
                del saves[rid]
                self._told_finished.discard(rid)
        received, failed = self._recv_done | self._recv_failed, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return sending, received, failed

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
        if time.time() > shm.lease_end(bases[0], op.expires_at, cfg.lease_seconds):
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
