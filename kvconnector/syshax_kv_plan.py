"""The scheduler side of SyshaxShmConnector: which requests publish or load a transfer, the
arena's slabs, and what the answer says (docs/kv-connector.md). No torch: bookkeeping only.

Every hook that handles one request's transfer turns any exception into that request's
fallback (a prefill answers ``syshax_kv_fallback``, a decode recomputes its prompt), with the
cause logged, so no client and no other process can stop the engine through it; only an
exception that says the engine itself is broken (:func:`engine_broken`) goes through.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import syshax_kv_shm as shm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.syshax_kv_connector")
SegmentError = shm.SegmentError
MAX_LEASE_SECONDS = shm.MAX_LEASE_SECONDS


def engine_broken(exc: BaseException) -> bool:
    """Whether ``exc`` says the engine itself is broken rather than one request's transfer:
    the host is out of memory, the interpreter failed, or a CUDA error poisoned the device
    (``torch.AcceleratorError``, a RuntimeError naming it before torch 2.8). Those are never
    turned into a fallback: the engine stops as it would without the connector."""
    if isinstance(exc, MemoryError | SystemError):
        return True
    if type(exc).__name__ == "AcceleratorError":  # torch is not imported on this side
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


def cause(exc: BaseException) -> str:
    """What a log line and an answer say of ``exc``: a SegmentError's own words, otherwise
    its type too; bounded, as it may quote what a client sent."""
    text = str(exc) if isinstance(exc, SegmentError) else f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked; a bad value stops the engine at start."""

    shm_dir: str
    lease_seconds: float
    reap_interval_seconds: float
    claim_grace_seconds: float
    arena_bytes: int
    slab_bytes: int
    engine_id: str
    peer_engine_id: str | None
    staging_bytes: int = 512 << 20

    @classmethod
    def parse(cls, extra: dict[str, Any], default_engine_id: str) -> Settings:
        def number(key: str, default: float, low: float, high: float) -> float:
            value = extra.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"SyshaxShmConnector: {key} must be a number, got {value!r}")
            if not math.isfinite(value) or not low <= value <= high:
                raise ValueError(f"SyshaxShmConnector: {key} must be in [{low}, {high}]: {value}")
            return float(value)

        lease = number("lease_seconds", 30.0, 0.1, MAX_LEASE_SECONDS)
        slab_kib = int(number("slab_kib", 2048, 4, 1 << 20))
        if slab_kib % 4:
            raise ValueError(f"SyshaxShmConnector: slab_kib must be a multiple of 4: {slab_kib}")
        arena = int(number("arena_mib", 1024, 0, 1 << 20) * 2**20)
        return cls(
            shm_dir=str(extra.get("shm_dir") or "/dev/shm"),
            lease_seconds=lease,
            reap_interval_seconds=number("reap_interval_seconds", 2.0, 0.05, 3600),
            claim_grace_seconds=number("claim_grace_seconds", lease, 0.1, MAX_LEASE_SECONDS),
            arena_bytes=arena // (slab_kib * 1024) * slab_kib * 1024,
            slab_bytes=slab_kib * 1024,
            engine_id=str(extra.get("engine_id") or default_engine_id),
            peer_engine_id=str(extra.get("peer_engine_id") or "") or None,
            staging_bytes=int(number("staging_mib", 512, 1, 1 << 20) * 2**20),
        )


@dataclass
class StoreOp:
    request_id: str
    transfer_id: str
    num_tokens: int
    block_ids: list[int]
    expires_at: float
    run: shm.Run


@dataclass
class LoadOp:
    request_id: str
    transfer_id: str
    ranks: int
    expires_at: float
    start: int  # first token position to load (tokens before it are cached locally)
    end: int  # one past the last
    block_ids: list[int] = field(default_factory=list)
    error: str | None = None  # the scheduler could not prepare it: the worker fails it


@dataclass
class SyshaxShmMetadata(KVConnectorMetadata):
    stores: list[StoreOp] = field(default_factory=list)
    loads: list[LoadOp] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # transfer ids not to publish


@dataclass
class _Planned:
    """Scheduler side: a store handed to the workers, until they report it landed."""

    transfer_id: str
    run: shm.Run
    expires_at: float
    params: dict[str, Any]
    cancelled: bool = False


@dataclass(frozen=True)
class Engine:
    """What both sides know of their engine."""

    cfg: Settings
    block_size: int
    tp: int
    ipc_ns: str
    geometry: dict[str, Any]
    dp_rank: int = 0
    model_name: str = ""

    def arena_file(self, rank: int) -> str:
        """The name of this engine's arena of tensor-parallel ``rank`` (pipeline
        parallelism is refused at start, so its rank is 0)."""
        return shm.arena_name(self.cfg.engine_id, rank, dp_rank=self.dp_rank)


class Unbound(shm.SegmentError):
    """The transfer's KV is not bound to this request's prompt: its digest differs or is
    missing."""

    def __init__(self, message: str, why: shm.Cause) -> None:
        super().__init__(message)
        self.cause = why


def adapter_of(request: Any) -> str | None:
    """The LoRA adapter a request runs with (its name), or None."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else str(getattr(lora, "lora_name", lora))


class Planner:
    """The scheduler-side hooks of the connector."""

    def __init__(
        self, engine: Engine, *, page_bytes: int, layers: int, block_ids: Callable[[str], list[int]]
    ) -> None:
        cfg = engine.cfg
        self._cfg = cfg
        self._engine_id = cfg.engine_id
        self._engine = engine
        self.tally = shm.Tally()
        self._local_hits: set[str] = set()  # req ids whose transfer the local cache covered
        self._host_unregistered: str | None = None  # why every prefill falls back
        self._owner_checked = False
        self._block_size = engine.block_size
        self._tp = engine.tp
        self._ipc_ns = engine.ipc_ns
        self._geometry = engine.geometry
        self._page_bytes = page_bytes  # one block of one layer on one rank
        self._num_layers = layers
        self._block_ids_of = block_ids
        self._slabs = shm.SlabAllocator(cfg.arena_bytes // cfg.slab_bytes, cfg.slab_bytes)
        # req id -> (transfer id, tokens, prompt digest)
        self._want_store: dict[str, tuple[str, int, str]] = {}
        self._planned: dict[str, _Planned] = {}  # req id -> store in flight
        self._published: dict[str, tuple[shm.Run, float]] = {}  # tid -> run, lease expiry
        self._fallbacks: dict[str, str] = {}  # req id -> why its KV was not published
        self._cancels: list[str] = []
        self._need_load: dict[str, LoadOp] = {}
        self._ready_loads: dict[str, LoadOp] = {}
        self._loading: set[str] = set()  # req ids whose load the workers have
        self._load_errors: dict[str, str] = {}  # req id -> why it recomputes its prompt
        self._stop = threading.Event()
        self._recover_runs()
        self._reaper = threading.Thread(
            target=self._reap_forever, name="syshax-kv-reaper", daemon=True
        )
        self._reaper.start()

    def shutdown(self) -> None:
        self._stop.set()

    def _transfer_bytes(self, num_tokens: int) -> int:
        """An upper bound of one rank's bytes for ``num_tokens`` tokens, every layer."""
        blocks = -(-num_tokens // self._block_size)
        return self._num_layers * shm.align_up(blocks * self._page_bytes)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return 0, False
        wants_store = params.get("do_remote_decode")
        if wants_store is not None and wants_store is not False:
            self._match_store(request, wants_store)
            return 0, False
        if "transfer_id" not in params:
            return 0, False
        return self._match_load(request, params, num_computed_tokens)

    def _match_store(self, request: Request, wants_store: Any) -> None:
        rid = request.request_id
        if rid in self._want_store or rid in self._planned or rid in self._fallbacks:
            return  # asked again (still waiting, or preempted): one transfer per request
        try:
            if wants_store is not True:
                raise SegmentError(f"do_remote_decode {shm.show(wants_store, 32)} is not true")
            token_ids = list(request.prompt_token_ids or ())
            model = self._engine.model_name
            digest = shm.prompt_digest(token_ids, model, adapter_of(request))
        except Exception as exc:
            if engine_broken(exc):
                raise
            self._fall_back(rid, cause(exc))
            return
        self._want_store[rid] = (uuid.uuid4().hex, len(token_ids), digest)

    def _match_load(
        self, request: Request, params: dict[str, Any], num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid in self._load_errors or rid in self._local_hits:
            return 0, False  # refused, failed, or held locally: nothing to load
        try:
            op = self._check_transfer(request, params)
            if op.end <= num_computed_tokens:
                # The local prefix cache already holds all of it: its slabs go back now,
                # not at the end of its lease.
                shm.unlink_transfer(self._cfg.shm_dir, op.transfer_id, op.ranks, op.expires_at)
                self._local_hits.add(rid)
                self.tally.add(shm.Cause.LOCAL_HIT)
                return 0, False
            op.start = num_computed_tokens
        except Exception as exc:  # any bad field: recompute, never fail the engine
            if engine_broken(exc):
                raise
            self._need_load.pop(rid, None)
            self._load_errors[rid] = why = cause(exc)
            kind = getattr(exc, "cause", shm.Cause.REFUSED)
            logger.error(
                "SyshaxShmConnector %s: request %s recomputes its prompt, transfer %s unusable "
                "(%s, %d so far): %s",
                self._engine_id,
                rid,
                shm.show(params.get("transfer_id")),
                kind.value,
                self.tally.add(kind),
                why,
            )
            return 0, False
        self._need_load[rid] = op
        return op.end - num_computed_tokens, True

    def _check_transfer(self, request: Request, params: dict[str, Any]) -> LoadOp:
        checked = shm.check_params(
            params,
            engine_id=self._engine_id,
            peer_engine_id=self._cfg.peer_engine_id,
            ipc_ns=self._ipc_ns,
            geometry=self._geometry,
            tensor_parallel=self._tp,
            prompt_tokens=len(request.prompt_token_ids or ()),
            max_lease_seconds=self._cfg.lease_seconds,
        )
        tid, ranks, expires = checked.transfer_id, checked.ranks, checked.expires_at
        prompt = list(request.prompt_token_ids or ())[: checked.num_tokens]
        unbound = shm.check_digest(params, prompt, self._engine.model_name, adapter_of(request))
        if unbound is shm.Cause.DIGEST_MISSING:
            raise Unbound(
                f"transfer {tid} carries no prompt_digest (a producer older than the digest, "
                "or parameters stripped of it): nothing binds its KV to this prompt",
                unbound,
            )
        if unbound is not None:
            raise Unbound(
                f"transfer {tid} holds the KV of another prompt, model or adapter: its "
                f"prompt_digest is not that of this request's first {checked.num_tokens} "
                f"tokens on model {self._engine.model_name!r}",
                unbound,
            )
        now = time.time()
        first = os.path.join(self._cfg.shm_dir, shm.segment_name(tid, 0, expires))
        if now > shm.lease_end(first, expires, self._cfg.lease_seconds):
            shm.unlink_transfer(self._cfg.shm_dir, tid, ranks, expires)
            raise SegmentError(
                f"segment {shm.segment_name(tid, 0, expires)} expired {now - expires:.1f}s "
                "ago (its lease ended before the decode arrived)"
            )
        for rank in range(ranks):
            base = os.path.join(self._cfg.shm_dir, shm.segment_name(tid, rank, expires))
            if os.path.exists(base + ".claimed"):
                raise SegmentError(f"segment {os.path.basename(base)} is already claimed")
            if not (os.path.exists(base) or os.path.exists(base + ".tmp")):
                raise SegmentError(shm.not_found(base, self._cfg.shm_dir, self._ipc_ns))
        return LoadOp(request.request_id, tid, ranks, expires, 0, checked.num_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        op = self._need_load.pop(rid, None)
        if op is None or num_external_tokens <= 0:
            return
        try:
            op.block_ids = list(blocks.get_block_ids()[0])
        except Exception as exc:  # the request waits for this load: the worker fails it
            if engine_broken(exc):
                raise
            op.error = f"its blocks are unknown: {cause(exc)}"
        self._ready_loads[rid] = op
        self._loading.add(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SyshaxShmMetadata(loads=list(self._ready_loads.values()), cancels=self._cancels)
        self._ready_loads, self._cancels = {}, []
        if not self._want_store:
            return meta
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = cached.num_computed_tokens[i]
        for rid, (tid, prompt, digest) in list(self._want_store.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(rid)
            if scheduled is None or rid not in computed:
                continue
            if computed[rid] + scheduled < prompt:
                continue  # chunked prefill: the prompt completes in a later step
            del self._want_store[rid]
            try:
                op = self._plan_store(rid, tid, prompt, digest)
            except Exception as exc:  # never fail the engine: the request falls back
                if engine_broken(exc):
                    raise
                self._release_plan(rid)
                self._fall_back(rid, f"error: {cause(exc)}")
                continue
            if op is not None:
                meta.stores.append(op)
        return meta

    def _plan_store(self, rid: str, tid: str, prompt: int, digest: str) -> StoreOp | None:
        cfg = self._cfg
        unregistered = self._arena_unregistered()
        if unregistered is not None:
            self.tally.add(shm.Cause.HOST_REGISTER)
            self._fall_back(rid, unregistered)
            return None
        need = self._transfer_bytes(prompt)
        run = self._allocate(need)
        if run is None:
            self.tally.add(shm.Cause.ARENA_FULL)
            self._fall_back(
                rid,
                "this engine has no KV arena (arena_mib 0)"
                if not self._slabs.slabs
                else f"arena full: the transfer needs {shm.size(need)}, the largest free run is "
                f"{shm.size(self._slabs.largest_free_run() * cfg.slab_bytes)} of "
                f"{shm.size(self._slabs.capacity)}",
            )
            return None
        # Whole seconds (the name carries them), rounded up: a lease is never shorter than asked.
        expires_at = float(math.ceil(time.time() + cfg.lease_seconds))
        # Held from here: a failure below gives the run and the files back (_release_plan).
        planned = self._planned[rid] = _Planned(tid, run, expires_at, params={})
        for rank in range(self._tp):
            pending = shm.segment_header(
                tid,
                rank,
                engine_id=self._engine_id,
                arena_file=self._engine.arena_file(rank),
                run=run,
                slab_bytes=cfg.slab_bytes,
                num_tokens=prompt,
                expires_at=expires_at,
            )
            name = shm.segment_name(tid, rank, expires_at) + ".tmp"
            shm.write_file(os.path.join(cfg.shm_dir, name), shm.encode_header(pending))
        blocks = list(self._block_ids_of(rid))
        planned.params = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "segment": shm.segment_name(tid, 0, expires_at),
            "num_tokens": prompt,
            "prompt_digest": digest,
            "ranks": self._tp,
            "lease_expires_at": int(expires_at),
            "producer_engine_id": self._engine_id,
            "ipc_namespace": self._ipc_ns,
            "geometry": self._geometry,
        }
        return StoreOp(rid, tid, prompt, blocks, expires_at, run)

    def _arena_unregistered(self) -> str | None:
        """Why this engine's arena cannot take copies (CUDA refused to register it, as its
        workers wrote in their owner records), or None. Read until every rank's record says
        it is ready (the workers write them before the engine serves), then kept."""
        if self._owner_checked or not self._slabs.slabs:
            return self._host_unregistered
        records = []
        for rank in range(self._tp):
            path = os.path.join(self._cfg.shm_dir, self._engine.arena_file(rank))
            records.append(shm.arena.read_owner(path))
        for record in records:
            if record is not None and record.get("host_registered") is False:
                self._host_unregistered = str(record.get("fallback") or "arena not registered")
        self._owner_checked = all(r is not None and r.get("ready") for r in records)
        return self._host_unregistered

    def _fall_back(self, rid: str, why: str) -> None:
        self._fallbacks[rid] = why
        logger.warning(
            "SyshaxShmConnector %s: request %s falls back (decoded where it was prefilled): %s",
            self._engine_id,
            rid,
            why,
        )

    def _release_plan(self, rid: str) -> None:
        """Undo a store that failed while it was planned: its files and its run."""
        planned = self._planned.pop(rid, None)
        if planned is None:
            return
        shm.unlink_transfer(self._cfg.shm_dir, planned.transfer_id, self._tp, planned.expires_at)
        self._slabs.mark(planned.run, False)

    def _allocate(self, nbytes: int) -> shm.Run | None:
        if not self._slabs.slabs or nbytes > self._slabs.capacity:
            return None
        run = self._slabs.allocate(nbytes)
        if run is None:
            self._reclaim()
            run = self._slabs.allocate(nbytes)
        return run

    def _reclaim(self) -> None:
        """Free the runs of published transfers whose every file is gone (loaded or reaped)."""
        for tid, (run, expires_at) in list(self._published.items()):
            if not shm.transfer_alive(self._cfg.shm_dir, tid, self._tp, expires_at):
                del self._published[tid]
                self._slabs.mark(run, False)

    def _recover_runs(self) -> None:
        """After a restart: runs that live segments of this engine's arena still hold."""
        if not self._slabs.slabs:
            return
        arena = self._engine.arena_file(0)
        for tid, run, _rank, expires_at in shm.live_runs(self._cfg.shm_dir, arena):
            with contextlib.suppress(ValueError):
                self._slabs.mark(run, True)
                self._published[tid] = (run, expires_at)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_sending or ():
            try:
                self._sent(rid)
            except Exception as exc:  # bookkeeping of one transfer: never the engine's step
                if engine_broken(exc):
                    raise
                logger.error(
                    "SyshaxShmConnector %s: request %s sent, its run not recorded: %s",
                    self._engine_id,
                    rid,
                    cause(exc),
                )
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for rid in connector_output.finished_recving or ():
            if rid in failed and rid in self._loading:
                # vLLM recomputes it (kv_load_failure_policy "recompute") and asks again.
                self._load_errors.setdefault(rid, "its load failed (logged above)")
                self.tally.add(shm.Cause.LOAD_FAILED)
            self._loading.discard(rid)

    def _sent(self, rid: str) -> None:
        planned = self._planned.pop(rid, None)
        if planned is None:
            return
        if planned.cancelled:
            self._slabs.mark(planned.run, False)  # the worker discarded it
        else:
            self._published[planned.transfer_id] = (planned.run, planned.expires_at)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        try:
            return self._finished(request)
        except Exception as exc:
            if engine_broken(exc):
                raise
            why = f"error: {cause(exc)}"
            logger.error("SyshaxShmConnector %s: request %s: %s", self._engine_id, rid, why)
            planned = self._planned.get(rid)
            if planned is None:
                return False, {"syshax_kv_fallback": why}
            # Its copy may be in flight: the blocks stay until the worker has discarded it.
            planned.cancelled = True
            self._cancels.append(planned.transfer_id)
            return True, {"syshax_kv_fallback": why}

    def _finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._want_store.pop(rid, None)
        self._need_load.pop(rid, None)
        self._ready_loads.pop(rid, None)
        self._loading.discard(rid)
        self._local_hits.discard(rid)
        error = self._load_errors.pop(rid, None)
        fallback = self._fallbacks.pop(rid, None)
        planned = self._planned.get(rid)
        if planned is None:
            if fallback and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
                return False, {"syshax_kv_fallback": fallback}
            return False, ({"syshax_kv_error": error} if error else None)
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # Stopped by itself (nothing left to decode), aborted or failed: the copy may be
            # in flight, so the blocks stay until the worker has discarded it.
            planned.cancelled = True
            self._cancels.append(planned.transfer_id)
            return True, None
        # The copy may still be in flight: the blocks stay until get_finished reports it.
        return True, planned.params

    def _reap_forever(self) -> None:
        while not self._stop.wait(self._cfg.reap_interval_seconds):
            try:
                shm.reap_expired(
                    self._cfg.shm_dir,
                    claim_grace=self._cfg.claim_grace_seconds,
                    lease=self._cfg.lease_seconds,
                )
                shm.reap_arenas(self._cfg.shm_dir)
            except OSError as exc:  # keep reaping; a transient error must not kill leases
                logger.warning("SyshaxShmConnector: reaping %s failed: %s", self._cfg.shm_dir, exc)
