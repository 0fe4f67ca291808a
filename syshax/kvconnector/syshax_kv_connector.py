"""SyshaxShmConnector: hands a request's KV cache from the prefill engine to the decode engine
through POSIX shared memory, for vLLM's V1 KV connector API (``KVConnectorBase_V1``).

Both engines run in one IPC namespace (the CPU container joins the GPU container's with
``--ipc container:<gpu>``), so ``/dev/shm`` is the same tmpfs for both. Load it in each
engine with::

    --kv-transfer-config '{"kv_connector": "SyshaxShmConnector",
      "kv_connector_module_path": "syshax_kv_connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"shm_dir": "/dev/shm", "lease_seconds": 30,
                                    "engine_id": "gpu-a", "peer_engine_id": "cpu-a"}}'

with this file's directory on the engine's ``PYTHONPATH``. The file is self-contained (vLLM,
torch and the standard library only) so an engine image without the syshax package can load
it; the node agent mounts or points at it (docs/kv-connector.md).

Protocol (one transfer per request, keyed by a random transfer id, never by prompt content):

1. Prefill: the request carries ``kv_transfer_params: {"do_remote_decode": true}``. In the
   step that completes the prompt, each attention layer's KV of every prompt token is copied
   into one segment ``<shm_dir>/syshax-kv-<transfer id>-r<rank>-<lease expiry>``, written
   under a temporary name and renamed when complete. The response's ``kv_transfer_params``
   name the transfer: ``transfer_id``, ``segment``, ``num_tokens``, ``lease_expires_at``,
   ``producer_engine_id``, ``ipc_namespace``, ``geometry``, ``ranks``.
2. Decode: the request's prompt is the prefill's prompt token ids followed by at least one
   more token (the one the prefill sampled), with those ``kv_transfer_params``. The decode
   engine checks the segment (present, lease not expired, same IPC namespace, produced by
   its peer, same model geometry), claims it by renaming, loads ``num_tokens`` tokens of KV
   into its own paged cache and unlinks it. vLLM counts the loaded tokens as cached prompt
   tokens (``usage.prompt_tokens_details.cached_tokens`` with
   ``--enable-prompt-tokens-details``, and ``vllm:external_prefix_cache_hits_total``).
   A segment that fails a check is not used: the engine logs the cause at ERROR and
   recomputes the prompt, which the router sees as ``cached_tokens`` short of
   ``num_tokens`` (its ``kv_miss`` outcome).
3. Leases: every engine with this connector unlinks expired ``syshax-kv-*`` segments in its
   shm dir (a reaper thread, every ``reap_interval_seconds``), so a transfer whose decode
   never comes (the client left) is freed when its lease ends. A prefill that finished on
   a stop token (nothing left to decode) unlinks its segment at once.

KV layout: vLLM 0.32 hands connectors one standardized ``[blocks, heads, block_size, C]``
view per layer on every attention backend, so a token's KV is ``layer[block, :, offset]``
on both the CUDA and the CPU backend. Segments store ``[tokens, heads, C]`` per layer, in
layer order. Tensor parallelism: each producer rank writes the segment of its own heads;
a consumer with one rank concatenates the ranks' heads. MLA and hybrid (Mamba) models are
not supported (refused at start-up).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so the engine's own logging configuration prints it.
logger = init_logger("vllm.syshax_kv_connector")

MAGIC = b"SYSHAXKV"
FORMAT_VERSION = 1
HEADER_SPACE = 1 << 16  # the JSON header lives in the first 64 KiB; data follows, aligned
SEGMENT_PREFIX = "syshax-kv-"
SEGMENT_RE = re.compile(
    r"^syshax-kv-(?P<tid>[0-9a-f]{32})-r(?P<rank>\d+)-(?P<exp>\d+)(?P<claimed>\.claimed)?$"
)
CLAIM_GRACE_SECONDS = 60.0  # a claimed segment whose consumer died is reaped this much later
# Attention backends whose page view holds each token's K|V as one row (vLLM 0.32's CUDA
# backends): they write and read the canonical per-token segment format.
PLAIN_TOKEN_BACKENDS = frozenset({"FlashAttentionImpl", "TritonAttentionImpl"})


def ipc_namespace() -> str:
    """The IPC namespace of this process (``ipc:[4026531839]``), or ``unknown``."""
    try:
        return os.readlink("/proc/self/ns/ipc")
    except OSError:
        return "unknown"


def segment_name(transfer_id: str, rank: int, expires_at: float) -> str:
    return f"{SEGMENT_PREFIX}{transfer_id}-r{rank}-{int(expires_at)}"


class SegmentError(Exception):
    """A transfer's segment cannot be used; the message names the cause."""


@dataclass
class StoreOp:
    transfer_id: str
    num_tokens: int
    block_ids: list[int]
    expires_at: float


@dataclass
class LoadOp:
    request_id: str
    transfer_id: str
    ranks: int
    expires_at: float
    start: int  # first token position to load (tokens before it are cached locally)
    end: int  # one past the last
    block_ids: list[int] = field(default_factory=list)


@dataclass
class SyshaxShmMetadata(KVConnectorMetadata):
    stores: list[StoreOp] = field(default_factory=list)
    loads: list[LoadOp] = field(default_factory=list)


@dataclass
class _Published:
    params: dict[str, Any]
    names: list[str]


class SyshaxShmConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        self._shm_dir = str(extra.get("shm_dir") or "/dev/shm")
        self._lease = float(extra.get("lease_seconds", 30.0))
        self._reap_interval = float(extra.get("reap_interval_seconds", 2.0))
        self._engine_id = str(extra.get("engine_id") or transfer.engine_id)
        self._peer = str(extra.get("peer_engine_id") or "") or None
        self._block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        model = vllm_config.model_config
        self._tp = parallel.tensor_parallel_size
        self._ipc_ns = ipc_namespace()
        if getattr(model, "use_mla", False):
            raise ValueError("SyshaxShmConnector does not support MLA models")
        # Geometry both engines must share for a segment to be usable (total KV heads, so a
        # tensor-parallel producer and a single-rank consumer agree).
        self._geometry = {
            "layers": model.get_num_layers(parallel),
            "kv_heads": model.get_total_num_kv_heads(),
            "head_size": model.get_head_size(),
            "kv_dtype": str(vllm_config.cache_config.cache_dtype),
            "model_dtype": str(model.dtype),
        }
        os.makedirs(self._shm_dir, exist_ok=True)
        # Scheduler side.
        self._want_store: dict[str, tuple[str, int]] = {}  # req id -> (transfer id, tokens)
        self._published: dict[str, _Published] = {}
        self._need_load: dict[str, LoadOp] = {}
        self._load_errors: dict[str, str] = {}
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._rank = 0
        self._writing: dict[str, tuple[int, mmap.mmap, dict[str, Any]]] = {}
        self._invalid_blocks: set[int] = set()
        self._stop = threading.Event()
        if role == KVConnectorRole.SCHEDULER:
            self._reaper = threading.Thread(
                target=self._reap_forever, name="syshax-kv-reaper", daemon=True
            )
            self._reaper.start()
        logger.info(
            "SyshaxShmConnector %s (%s): shm %s, lease %.0fs, IPC namespace %s, peer %s",
            self._engine_id,
            role.name.lower(),
            self._shm_dir,
            self._lease,
            self._ipc_ns,
            self._peer or "any",
        )

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if params.get("do_remote_decode"):
            prompt = len(request.prompt_token_ids or ())
            self._want_store.setdefault(rid, (uuid.uuid4().hex, prompt))
            return 0, False
        if "transfer_id" not in params:
            return 0, False
        try:
            op = self._check_transfer(request, params)
        except SegmentError as exc:
            self._need_load.pop(rid, None)
            if rid not in self._load_errors:
                logger.error(
                    "SyshaxShmConnector %s: request %s recomputes its prompt, transfer %s "
                    "unusable: %s",
                    self._engine_id,
                    rid,
                    params.get("transfer_id"),
                    exc,
                )
            self._load_errors[rid] = str(exc)
            return 0, False
        if op.end <= num_computed_tokens:
            return 0, False  # the local prefix cache already holds all of it
        op.start = num_computed_tokens
        self._need_load[rid] = op
        return op.end - num_computed_tokens, False

    def _check_transfer(self, request: Request, params: dict[str, Any]) -> LoadOp:
        tid = str(params.get("transfer_id", ""))
        if not re.fullmatch(r"[0-9a-f]{32}", tid):
            raise SegmentError(f"transfer_id {tid!r} is not a syshax transfer id")
        producer = params.get("producer_engine_id")
        if self._peer and producer != self._peer:
            raise SegmentError(
                f"transfer {tid} was produced by engine {producer!r}; this engine "
                f"({self._engine_id}) decodes for {self._peer!r}"
            )
        their_ns = params.get("ipc_namespace")
        if their_ns and their_ns != self._ipc_ns:
            raise SegmentError(
                f"segment is in IPC namespace {their_ns} and this engine is in {self._ipc_ns}:"
                " run the CPU engine in the GPU engine's IPC namespace (--ipc container:<gpu>)"
            )
        if params.get("geometry") != self._geometry:
            raise SegmentError(
                f"segment geometry {params.get('geometry')} differs from this engine's "
                f"{self._geometry} (another model or dtype)"
            )
        try:
            num_tokens = int(params["num_tokens"])
            ranks = int(params.get("ranks", 1))
            expires_at = float(params["lease_expires_at"])
        except (KeyError, TypeError, ValueError):
            raise SegmentError("kv_transfer_params lack num_tokens/lease_expires_at") from None
        if self._tp != 1:
            raise SegmentError("a decode engine with tensor parallelism > 1 cannot load segments")
        prompt = len(request.prompt_token_ids or ())
        if num_tokens >= prompt:
            raise SegmentError(
                f"the prompt has {prompt} tokens; it must extend the {num_tokens} transferred "
                "tokens by at least the token the prefill sampled"
            )
        for rank in range(ranks):
            name = segment_name(tid, rank, expires_at)
            path = os.path.join(self._shm_dir, name)
            claimed = path + ".claimed"
            if os.path.exists(claimed):
                continue
            if time.time() > expires_at:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise SegmentError(
                    f"segment {name} expired {time.time() - expires_at:.1f}s ago "
                    "(its lease ended before the decode arrived)"
                )
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                raise SegmentError(
                    f"segment {name} not found in {self._shm_dir} (already used, reaped, or "
                    f"written in another IPC namespace; this engine is in {self._ipc_ns})"
                ) from None
        return LoadOp(request.request_id, tid, ranks, expires_at, 0, num_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            self._need_load.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SyshaxShmMetadata()
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            op = self._need_load.pop(new.req_id, None)
            if op is not None:
                op.block_ids = list(new.block_ids[0])
                meta.loads.append(op)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = cached.num_computed_tokens[i]
        for rid, (tid, prompt) in list(self._want_store.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(rid)
            if scheduled is None or rid not in computed:
                continue
            if computed[rid] + scheduled < prompt:
                continue  # chunked prefill: the prompt completes in a later step
            del self._want_store[rid]
            expires_at = time.time() + self._lease
            blocks = list(self._kv_cache_manager.get_block_ids(rid)[0])
            meta.stores.append(StoreOp(tid, prompt, blocks, expires_at))
            self._published[rid] = _Published(
                params={
                    "do_remote_prefill": True,
                    "transfer_id": tid,
                    "segment": segment_name(tid, 0, expires_at),
                    "num_tokens": prompt,
                    "ranks": self._tp,
                    "lease_expires_at": int(expires_at),
                    "producer_engine_id": self._engine_id,
                    "ipc_namespace": self._ipc_ns,
                    "geometry": self._geometry,
                },
                names=[segment_name(tid, r, expires_at) for r in range(self._tp)],
            )
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._want_store.pop(rid, None)
        self._need_load.pop(rid, None)
        error = self._load_errors.pop(rid, None)
        published = self._published.pop(rid, None)
        if published is None:
            return False, ({"syshax_kv_error": error} if error else None)
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED):
            # Nothing will decode this request: free its segment now, not at lease end.
            self._unlink(published.names)
            return False, None
        # Saves are synchronous (the segment is complete when its step ends), so vLLM may
        # free the blocks at once.
        return False, published.params

    def _unlink(self, names: list[str]) -> None:
        for name in names:
            for suffix in ("", ".claimed", ".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self._shm_dir, name + suffix))

    def _reap_forever(self) -> None:
        while not self._stop.wait(self._reap_interval):
            try:
                reap_expired(self._shm_dir)
            except OSError as exc:  # keep reaping; a transient error must not kill leases
                logger.warning("SyshaxShmConnector: reaping %s failed: %s", self._shm_dir, exc)

    def shutdown(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
        except (AssertionError, ImportError, RuntimeError):
            self._rank = 0
        first = next(iter(kv_caches.values()), None)
        logger.info(
            "SyshaxShmConnector %s: %d KV layers, layer view %s %s, rank %d",
            self._engine_id,
            len(kv_caches),
            tuple(first.shape) if first is not None else None,
            first.dtype if first is not None else None,
            self._rank,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SyshaxShmMetadata)
        for op in meta.loads:
            started = time.perf_counter()
            try:
                self._load(op, forward_context)
            except (SegmentError, OSError, ValueError, RuntimeError) as exc:
                # The scheduler already counted these tokens as computed: report the blocks
                # so vLLM fails (or recomputes, per kv_load_failure_policy) the request.
                logger.error(
                    "SyshaxShmConnector %s: request %s cannot load transfer %s: %s",
                    self._engine_id,
                    op.request_id,
                    op.transfer_id,
                    exc,
                )
                first = op.start // self._block_size
                last = -(-op.end // self._block_size)
                self._invalid_blocks.update(op.block_ids[first:last])
                continue
            finally:
                self._unlink_claimed(op)
            logger.info(
                "SyshaxShmConnector %s: request %s loaded %d tokens of transfer %s in %.1f ms",
                self._engine_id,
                op.request_id,
                op.end - op.start,
                op.transfer_id,
                1000 * (time.perf_counter() - started),
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._invalid_blocks = self._invalid_blocks, set()
        return failed

    def _unlink_claimed(self, op: LoadOp) -> None:
        for rank in range(op.ranks):
            name = segment_name(op.transfer_id, rank, op.expires_at) + ".claimed"
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._shm_dir, name))

    def _layout(self, layer_name: str, cache: torch.Tensor, context: Any = None) -> dict[str, Any]:
        """What a page of this engine's cache holds: the attention backend, its CPU
        instruction set (which decides the packing inside a CPU page) and the page shape."""
        layer = None
        if context is not None:
            layer = context.no_compile_layers.get(layer_name)
        if layer is None:
            from vllm.forward_context import get_forward_context

            with contextlib.suppress(AssertionError, AttributeError, RuntimeError):
                layer = get_forward_context().no_compile_layers.get(layer_name)
        backend = ""
        impl = getattr(layer, "impl", None)
        if impl is not None:
            backend = type(impl).__name__
        return {
            "backend": backend,
            "isa": getattr(layer, "isa", None),
            "page": list(cache.shape[1:]),
            "dtype": str(cache.dtype).removeprefix("torch."),
        }

    def _load(self, op: LoadOp, context: ForwardContext) -> None:
        sources = []
        for rank in range(op.ranks):
            name = segment_name(op.transfer_id, rank, op.expires_at) + ".claimed"
            sources.append(read_segment(os.path.join(self._shm_dir, name)))
        fmt = sources[0][0].get("format")
        for layer_name, cache in self._kv_caches.items():
            parts = []
            for header, buffer in sources:
                info = header["layers"].get(layer_name)
                if info is None:
                    raise SegmentError(f"segment has no layer {layer_name}")
                parts.append(_layer_tensor(buffer, info))
            src = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if fmt == "pages":
                mine = self._layout(layer_name, cache, context)
                theirs = dict(sources[0][0]["layout"])
                theirs["page"] = [src.shape[1], *theirs["page"][1:]]
                if mine != theirs:
                    raise SegmentError(
                        f"the producer's KV pages ({theirs}) are not this engine's ({mine}); "
                        "a page copy needs the same attention backend and instruction set"
                    )
                first = op.start // self._block_size
                last = -(-op.end // self._block_size)
                dst = torch.tensor(op.block_ids[first:last], dtype=torch.long)
                cache[dst.to(cache.device)] = src[first:last].to(cache.device)
            elif fmt == "tokens":
                self._write_tokens(layer_name, cache, src[op.start : op.end], op, context)
            else:
                raise SegmentError(f"unknown segment format {fmt!r}")

    def _write_tokens(
        self, layer_name: str, cache: torch.Tensor, src: torch.Tensor, op: LoadOp, context: Any
    ) -> None:
        """Canonical ``[tokens, heads, 2 * head_size]`` (K then V) into this engine's pages."""
        positions = torch.arange(op.start, op.end)
        slots = self._slots(op.block_ids, positions).to(cache.device)
        src = src.to(cache.device, dtype=cache.dtype)
        layout = self._layout(layer_name, cache, context)
        if layout["backend"] in PLAIN_TOKEN_BACKENDS:
            kernel_block = cache.shape[2]
            cache[slots // kernel_block, :, slots % kernel_block] = src
            return
        if layout["backend"] == "CPUAttentionBackendImpl":
            # The CPU backend packs keys per instruction set: write through its own op.
            from vllm import _custom_ops as ops

            blocks, heads, block_size, _ = cache.shape
            halves = cache.view(blocks, heads, block_size * 2, -1)
            key_cache, value_cache = halves.chunk(2, dim=2)
            key, value = src.chunk(2, dim=-1)
            layer = context.no_compile_layers.get(layer_name)
            ops.cpu_attn_reshape_and_cache(
                key.contiguous(),
                value.contiguous(),
                key_cache,
                value_cache,
                slots,
                layout["isa"],
                k_scale=getattr(layer, "_k_scale_float", 1.0),
                v_scale=getattr(layer, "_v_scale_float", 1.0),
            )
            return
        raise SegmentError(f"no token writer for attention backend {layout['backend']!r}")

    def _slots(self, block_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long)
        return blocks[positions // self._block_size] * self._block_size + (
            positions % self._block_size
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SyshaxShmMetadata)
        if not meta.stores:
            return
        layout = self._layout(layer_name, kv_layer)
        for op in meta.stores:
            if layout["backend"] in PLAIN_TOKEN_BACKENDS:
                # Per-token K|V rows: canonical tokens any consumer backend can write.
                positions = torch.arange(op.num_tokens)
                slots = self._slots(op.block_ids, positions).to(kv_layer.device)
                kernel_block = kv_layer.shape[2]
                data = kv_layer[slots // kernel_block, :, slots % kernel_block]
                fmt = "tokens"
            else:
                # Packed pages (the CPU backend): copied whole, for a consumer of the same
                # backend and instruction set.
                used = -(-op.num_tokens // self._block_size)
                blocks = torch.tensor(op.block_ids[:used], dtype=torch.long)
                data = kv_layer[blocks.to(kv_layer.device)]
                fmt = "pages"
            self._write_layer(op, layer_name, data, fmt, layout)

    def _write_layer(
        self, op: StoreOp, layer_name: str, data: torch.Tensor, fmt: str, layout: dict[str, Any]
    ) -> None:
        name = segment_name(op.transfer_id, self._rank, op.expires_at)
        entry = self._writing.get(name)
        if entry is None:
            per_layer = data.numel() * data.element_size()
            size = HEADER_SPACE + per_layer * len(self._kv_caches)
            path = os.path.join(self._shm_dir, name + ".tmp")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            header: dict[str, Any] = {
                "transfer_id": op.transfer_id,
                "rank": self._rank,
                "producer_engine_id": self._engine_id,
                "ipc_namespace": ipc_namespace(),
                "num_tokens": op.num_tokens,
                "lease_expires_at": op.expires_at,
                "format": fmt,
                "layout": layout,
                "layers": {},
                "next_offset": HEADER_SPACE,
            }
            entry = (fd, mmap.mmap(fd, size), header)
            self._writing[name] = entry
        fd, mm, header = entry
        raw = data.detach().contiguous().cpu().view(torch.uint8).reshape(-1)
        offset = header["next_offset"]
        mm[offset : offset + raw.numel()] = raw.numpy().tobytes()
        header["layers"][layer_name] = {
            "offset": offset,
            "shape": list(data.shape),
            "dtype": str(data.dtype).removeprefix("torch."),
        }
        header["next_offset"] = offset + raw.numel()

    def wait_for_save(self) -> None:
        for name, (fd, mm, header) in list(self._writing.items()):
            del header["next_offset"]
            blob = json.dumps(header).encode()
            if len(blob) + 16 > HEADER_SPACE:
                raise RuntimeError("SyshaxShmConnector: segment header too large")
            lengths = FORMAT_VERSION.to_bytes(4, "little") + len(blob).to_bytes(4, "little")
            mm[0:16] = MAGIC + lengths
            mm[16 : 16 + len(blob)] = blob
            mm.close()
            os.close(fd)
            tmp = os.path.join(self._shm_dir, name + ".tmp")
            os.rename(tmp, os.path.join(self._shm_dir, name))
        self._writing.clear()


def read_segment(path: str) -> tuple[dict[str, Any], memoryview]:
    """The header and the data of a segment file (mapped, not copied)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SegmentError(f"segment {os.path.basename(path)} vanished before loading") from None
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if size < 16 or mm[0:8] != MAGIC:
        raise SegmentError(f"{os.path.basename(path)} is not a syshax KV segment")
    version = int.from_bytes(mm[8:12], "little")
    if version != FORMAT_VERSION:
        raise SegmentError(f"segment format {version}, this connector reads {FORMAT_VERSION}")
    length = int.from_bytes(mm[12:16], "little")
    header = json.loads(mm[16 : 16 + length])
    return header, memoryview(mm)


def _layer_tensor(buffer: memoryview, info: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, info["dtype"])
    shape = info["shape"]
    count = 1
    for dim in shape:
        count *= dim
    # bytes() copies out of the mapping so the file can be unlinked right after.
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    data = bytearray(buffer[info["offset"] : info["offset"] + nbytes])
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def reap_expired(shm_dir: str, now: float | None = None) -> list[str]:
    """Unlink expired segments (any producer's) in ``shm_dir``; returns their names."""
    now = time.time() if now is None else now
    removed = []
    for name in os.listdir(shm_dir):
        if not name.startswith(SEGMENT_PREFIX):
            continue
        base = name.removesuffix(".tmp")
        match = SEGMENT_RE.match(base)
        if match is None:
            continue
        expires = int(match.group("exp"))
        if match.group("claimed"):
            expires += CLAIM_GRACE_SECONDS
        if now > expires + (CLAIM_GRACE_SECONDS if name.endswith(".tmp") else 0):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
    return removed
