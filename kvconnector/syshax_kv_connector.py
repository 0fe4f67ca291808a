"""SyshaxShmConnector: hands a request's KV cache from the prefill engine to the decode engine
through POSIX shared memory, for vLLM's V1 KV connector API (``KVConnectorBase_V1``).

Both engines run in one IPC namespace (the CPU container joins the GPU container's with
``--ipc container:<gpu>``), so ``/dev/shm`` is the same tmpfs for both. Load it in each
engine with::

    --kv-transfer-config '{"kv_connector": "SyshaxShmConnector",
      "kv_connector_module_path": "syshax_kv_connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"shm_dir": "/dev/shm", "lease_seconds": 30,
          "arena_mib": 1024, "engine_id": "gpu-a", "peer_engine_id": "cpu-a"}}'

with this file's directory on the engine's ``PYTHONPATH``. It needs vLLM, torch, the standard
library and its siblings, nothing else, so an engine image without the syshax package loads
it (docs/kv-connector.md): ``syshax_kv_shm.py`` (the shared-memory layout, standard library
only), ``syshax_kv_plan.py`` (the scheduler side) and ``syshax_kv_copy.py`` (the worker side).

Producer (the prefill engine). A request with ``kv_transfer_params: {"do_remote_decode":
true}``: in the step that completes its prompt the scheduler takes a run of slabs in this
engine's arena (pre-faulted, and on CUDA registered with the driver) and creates the
segment's ``.tmp`` file. Each layer's ``save_kv_layer`` gathers the request's KV on the
device and starts an asynchronous copy on a side CUDA stream, ordered after the forward by an
event, straight into the arena; ``wait_for_save`` only records the copies' completion event.
``request_finished`` keeps the blocks (returns True) and answers the transfer's parameters;
``get_finished`` reports the request once its copies have landed, which is when the segment
is published (renamed from ``.tmp``). On the CPU the gather writes into the arena directly,
the one copy there is. A full arena is not an error: the request answers
``syshax_kv_fallback`` in place of a transfer, the router decodes it on the GPU and counts it.

Consumer (the decode engine). A request whose ``kv_transfer_params`` carry a ``transfer_id``:
every field is checked (a failed check recomputes the prompt and logs why), then the load is
asynchronous: the request waits in vLLM's WAITING_FOR_REMOTE_KVS while the producer's copy is
still under way (the prefill's answer can arrive before it lands), bounded by the lease,
without holding this engine's steps. Once the segment is published it is claimed (renamed),
every size and offset of its header is checked against the arena mapping, and the KV is
written from the mapping itself into the engine's paged cache (the CPU backend's own
``cpu_attn_reshape_and_cache`` for per-token KV, a block copy for pages), then unlinked.
``get_finished`` reports it; a load that cannot finish is reported failed and vLLM recomputes
the prompt (the connector sets vLLM's ``kv_load_failure_policy`` to ``recompute``).

Nothing in a request's ``kv_transfer_params`` or in a segment stops an engine: every hook
that handles one request's transfer turns an exception into that request's fallback or
recompute with the cause logged; only one that means the engine is broken goes through.

KV layout: vLLM 0.32 hands connectors a ``[blocks, heads, block_size, C]`` view per layer.
CUDA's Flash/Triton backends hold each token's K|V in ``C``; their KV travels as *tokens*,
``[2, tokens, heads, head_size]`` (K then V) per layer, which any consumer writes into its
own cache. Other backends (the CPU one packs keys per instruction set) travel as *pages*,
copied block for block into an engine of the same backend. MLA and hybrid (Mamba) models
are refused at start-up.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import syshax_kv_shm as shm
import torch
from syshax_kv_copy import Copier
from syshax_kv_plan import Engine, Planner, Settings, SyshaxShmMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so the engine's own logging configuration prints it.
logger = init_logger("vllm.syshax_kv_connector")

__all__ = ["Settings", "SyshaxShmConnector", "SyshaxShmMetadata", "shm"]


class SyshaxShmConnector(KVConnectorBase_V1):
    """vLLM's hooks, each handed to the side it belongs to: the scheduler's to a
    :class:`Planner`, the worker's to a :class:`Copier`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        cfg = Settings.parse(
            dict(transfer.kv_connector_extra_config or {}), str(transfer.engine_id)
        )
        parallel = vllm_config.parallel_config
        model = vllm_config.model_config
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        refuse_unsupported(vllm_config, cfg, groups)
        served = getattr(model, "served_model_name", None)
        if isinstance(served, list | tuple):
            served = served[0] if served else None
        engine = Engine(
            cfg=cfg,
            block_size=vllm_config.cache_config.block_size,
            tp=parallel.tensor_parallel_size,
            ipc_ns=shm.ipc_namespace(),
            # What both engines must share for a segment to be usable (total KV heads, so a
            # tensor-parallel producer and a single-rank consumer agree).
            geometry={
                "layers": model.get_num_layers(parallel),
                "kv_heads": model.get_total_num_kv_heads(),
                "head_size": model.get_head_size(),
                "kv_dtype": str(vllm_config.cache_config.cache_dtype),
                "model_dtype": str(model.dtype),
            },
            dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
            # What the digest binds a transfer to: the name both engines serve (the router
            # sends one name to both), else the model's path.
            model_name=str(served or getattr(model, "model", "") or ""),
        )
        os.makedirs(cfg.shm_dir, exist_ok=True)
        self._planner: Planner | None = None
        self._copier = Copier(engine)
        self._layers = dict(
            getattr(
                getattr(vllm_config, "compilation_config", None), "static_forward_context", None
            )
            or {}
        )
        if role == KVConnectorRole.SCHEDULER:
            # A load that fails on the worker (a segment gone bad after its checks passed)
            # recomputes the prompt, as a refused one does; vLLM's default fails the request.
            # The scheduler reads this after it has built its connector.
            transfer.kv_load_failure_policy = "recompute"
            self._planner = Planner(
                engine,
                page_bytes=_page_bytes(engine, groups, model),
                layers=len(groups[0].layer_names) if groups else engine.geometry["layers"],
                block_ids=lambda rid: list(self._kv_cache_manager.get_block_ids(rid)[0]),
            )
        logger.info(
            "SyshaxShmConnector %s (%s): shm %s, lease %.0fs, arena %d MiB in %d KiB slabs, "
            "IPC namespace %s, peer %s; a transfer that fails recomputes its prompt",
            cfg.engine_id,
            role.name.lower(),
            cfg.shm_dir,
            cfg.lease_seconds,
            cfg.arena_bytes >> 20,
            cfg.slab_bytes >> 10,
            engine.ipc_ns,
            cfg.peer_engine_id or "any",
        )

    @property
    def planner(self) -> Planner:
        if self._planner is None:
            raise RuntimeError("a scheduler-side hook was called on the worker's connector")
        return self._planner

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.planner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.planner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.planner.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.planner.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.planner.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: nothing of this connector runs inside the forward. The saves gather in
        ``wait_for_save`` and the loads run in ``start_load_kv``, both outside any CUDA
        graph, so a full-graph (uniform decode) step saves what it finishes like any other."""
        return False

    def counts(self) -> dict[str, int]:
        """How often each cause (``syshax_kv_shm.Cause``) happened on this side."""
        tally = shm.Tally(self._copier.tally)
        if self._planner is not None:
            tally.update(self._planner.tally)
        return dict(tally)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._copier.register_kv_caches(kv_caches, self._layers)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._copier.start_load_kv(self._connector_metadata, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # gathered in wait_for_save, which full CUDA graphs do not skip

    def wait_for_save(self) -> None:
        self._copier.wait_for_save(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._copier.get_transfer_results(
            self._connector_metadata, finished_req_ids
        )
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self._planner is not None:
            self._planner.shutdown()
        self._copier.shutdown()


def refuse_unsupported(vllm_config: Any, cfg: Settings, groups: list[Any]) -> None:
    """Stop the engine at start, naming the setting, on what this connector cannot serve:
    each would otherwise fail or recompute every transfer, one request at a time."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    name = "SyshaxShmConnector"
    if getattr(model, "use_mla", False):
        raise ValueError(f"{name} does not support MLA models")
    if len(groups) > 1:
        raise ValueError(f"{name} does not support hybrid (several KV group) models")
    for setting in ("pipeline_parallel_size", "decode_context_parallel_size"):
        value = int(getattr(parallel, setting, 1) or 1)
        if value > 1:
            raise ValueError(f"{name} does not support {setting} {value} (only 1)")
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype.startswith("fp8"):
        raise ValueError(
            f"{name} does not support kv_cache_dtype {dtype!r}: the copies and the CPU writer "
            "carry no fp8 scales; run both engines with kv_cache_dtype 'auto'"
        )
    tp = int(parallel.tensor_parallel_size)
    heads = int(model.get_total_num_kv_heads())
    if tp > heads or heads % tp:
        raise ValueError(
            f"{name} does not support tensor_parallel_size {tp} over the model's {heads} KV "
            "heads: each rank must hold a whole, equal share of them"
        )
    role = str(getattr(vllm_config.kv_transfer_config, "kv_role", "kv_both") or "kv_both")
    if tp > 1 and (role == "kv_consumer" or not cfg.arena_bytes):
        raise ValueError(
            f"{name}: a decode engine (arena_mib 0 or kv_role kv_consumer) must have "
            f"tensor_parallel_size 1, not {tp}: it loads every rank's segment into one cache"
        )


def _page_bytes(engine: Engine, groups: list[Any], model: Any) -> int:
    """Bytes of one block of one layer on one rank: what runs of slabs are sized by."""
    size = getattr(groups[0].kv_cache_spec, "page_size_bytes", None) if groups else None
    if isinstance(size, int) and size > 0:
        return size
    dtype = getattr(model, "dtype", torch.bfloat16)
    item = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2
    heads = max(1, engine.geometry["kv_heads"] // engine.tp)
    return engine.block_size * heads * 2 * engine.geometry["head_size"] * item
