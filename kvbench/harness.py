"""Drive the KV connector's two sides as vLLM 0.32 does, outside an engine.

A producer engine and a consumer engine, each a scheduler-side and a worker-side
``SyshaxShmConnector`` over paged KV caches laid out as vLLM's attention backends lay them
out, sharing one shm directory. The connector file is loaded as vLLM loads it (its directory
on ``sys.path``, the module by name); vLLM's own modules are used where vLLM is installed and
stood in for where it is not (``standin.py``).

The calls and their order are the engine's: ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta`` on the scheduler side;
``bind_connector_metadata``, ``start_load_kv``, ``save_kv_layer`` after each layer of the
forward, ``wait_for_save``, ``get_transfer_results`` and ``clear_connector_metadata`` on the
worker side, one step after another; ``request_finished`` and ``update_connector_output`` as
the scheduler finishes a request and reads the workers' output.
"""

from __future__ import annotations

import importlib
import itertools
import random
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench import standin

CONNECTOR_DIR = Path(__file__).resolve().parents[1] / "kvconnector"
NS = types.SimpleNamespace


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    @property
    def page_bytes(self) -> int:
        """One block of one layer: K and V of every head."""
        item = int(torch.empty((), dtype=self.dtype).element_size())
        return self.block_size * self.kv_heads * 2 * self.head_size * item

    def kv_bytes(self, tokens: int) -> int:
        return self.layers * tokens * self.page_bytes // self.block_size


# An 8B-class model (Llama-3-8B's attention): 32 layers, 8 KV heads of 128, bf16.
EIGHT_B = Geometry(layers=32, kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16)
# The real-engine tier's tiny model, for quick checks.
TINY = Geometry(layers=2, kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=16)

# vLLM's attention implementations whose layouts the harness builds.
# CUDA: a [blocks, heads, block, 2 x head] view of [blocks, block, heads, 2 x head] memory.
FLASH = "FlashAttentionImpl"
# The CPU backend: [blocks, heads, block, 2 x head], keys then values inside a block.
CPU = "CPUAttentionBackendImpl"


def load_connector() -> types.ModuleType:
    """The connector module, imported as vLLM imports it."""
    standin.install()
    if str(CONNECTOR_DIR) not in sys.path:
        sys.path.insert(0, str(CONNECTOR_DIR))
    return importlib.import_module("syshax_kv_connector")


def request_status() -> Any:
    """vLLM's ``RequestStatus`` (or its stand-in)."""
    return importlib.import_module("vllm.v1.request").RequestStatus


def forward_context_override() -> Callable[[Any], Any]:
    module = importlib.import_module("vllm.forward_context")
    return module.override_forward_context  # type: ignore[no-any-return]


class Engine:
    """One engine's connector pair and paged KV cache."""

    def __init__(
        self,
        name: str,
        peer: str,
        geometry: Geometry,
        *,
        device: str,
        backend: str,
        num_blocks: int,
        shm_dir: Path,
        arena_mib: float,
        slab_kib: int = 2048,
        lease_seconds: float = 30.0,
        isa: str | None = None,
        engine_id: str | None = None,
        dp_rank: int = 0,
        draft_layers: int = 0,
        model_name: str = "tiny",
        extra: dict[str, Any] | None = None,
        parallel: dict[str, Any] | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``draft_layers``: a draft model's attention layers beside the target's, in the
        KV cache the connector is given (EAGLE's are); ``engine_id``: the configured id when
        it is not ``name`` (two engines, or two data-parallel ranks, given one)."""
        module = load_connector()
        self.module = module
        self.geometry = geometry
        self.device = torch.device(device)
        self.backend = backend
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(geometry.layers)]
        self.draft_names = [f"drafter.layers.{i}.self_attn.attn" for i in range(draft_layers)]
        self.all_layers = self.layer_names + self.draft_names
        impl = type(backend, (), {})()
        self.context = NS(no_compile_layers={n: NS(impl=impl, isa=isa) for n in self.all_layers})
        self.caches = {n: self._cache(num_blocks) for n in self.all_layers}
        self.free_blocks = list(range(num_blocks))
        random.Random(name).shuffle(self.free_blocks)  # scattered blocks, as in a busy engine
        extra = {
            "shm_dir": str(shm_dir),
            "lease_seconds": lease_seconds,
            "reap_interval_seconds": 3600,
            "arena_mib": arena_mib,
            "slab_kib": slab_kib,
            "engine_id": engine_id or name,
            "peer_engine_id": peer,
            **(extra or {}),
        }
        model = NS(
            use_mla=False,
            dtype=geometry.dtype,
            get_num_layers=lambda parallel: geometry.layers,
            get_total_num_kv_heads=lambda: geometry.kv_heads,
            get_head_size=lambda: geometry.head_size,
            served_model_name=model_name,
        )
        config = NS(
            kv_transfer_config=NS(
                kv_connector_extra_config=extra, engine_id=name, is_kv_producer=True
            ),
            cache_config=NS(block_size=geometry.block_size, cache_dtype=kv_cache_dtype),
            parallel_config=NS(
                **{"tensor_parallel_size": 1, "data_parallel_rank": dp_rank, **(parallel or {})}
            ),
            model_config=model,
            # The attention layers vLLM knows at start (its static forward context).
            compilation_config=NS(static_forward_context=self.context.no_compile_layers),
        )
        kv_config = NS(
            kv_cache_groups=[
                NS(
                    layer_names=self.all_layers,
                    kv_cache_spec=NS(page_size_bytes=geometry.page_bytes),
                )
            ]
        )
        self.request_blocks: dict[str, list[int]] = {}
        manager = NS(
            get_block_ids=lambda rid: (self.request_blocks[rid],),
            block_pool=None,
        )
        role = module.KVConnectorRole
        self.scheduler = module.SyshaxShmConnector(config, role.SCHEDULER, kv_config)
        self.scheduler.bind_kv_cache_manager(manager)
        self.worker = module.SyshaxShmConnector(config, role.WORKER, kv_config)
        self.worker.register_kv_caches(self.caches)
        self.override = forward_context_override()
        self.finished: set[str] = set()  # requests whose copies may still be in flight

    def _cache(self, num_blocks: int) -> torch.Tensor:
        g = self.geometry
        if self.backend == FLASH:
            physical = torch.empty(
                num_blocks, g.block_size, g.kv_heads, 2 * g.head_size, dtype=g.dtype,
                device=self.device,
            )  # fmt: skip
            view = physical.permute(0, 2, 1, 3)
        else:
            view = torch.empty(
                num_blocks, g.kv_heads, g.block_size, 2 * g.head_size, dtype=g.dtype,
                device=self.device,
            )  # fmt: skip
        return view

    def fill(self, seed: int = 0) -> None:
        """Random KV in every block (what a forward would have written)."""
        torch.manual_seed(seed)
        for cache in self.caches.values():
            cache.normal_()

    def allocate(self, rid: str, tokens: int) -> list[int]:
        need = -(-tokens // self.geometry.block_size)
        if need > len(self.free_blocks):
            raise RuntimeError(f"engine out of KV blocks: {need} needed")
        blocks, self.free_blocks = self.free_blocks[:need], self.free_blocks[need:]
        self.request_blocks[rid] = blocks
        return blocks

    def release(self, rid: str) -> None:
        self.free_blocks += self.request_blocks.pop(rid, [])

    # -- one engine step on the worker side

    @contextmanager
    def step(self, meta: Any, finished: set[str] | None = None) -> Iterator[Any]:
        """A worker step: metadata bound, the caller's forward inside, then the connector's
        end of step; yields a holder whose ``results`` are the step's transfer results."""
        holder = NS(results=None)
        worker = self.worker
        worker.bind_connector_metadata(meta)
        with self.override(self.context):
            try:
                yield holder
            finally:
                worker.start_load_kv(self.context)  # after the forward: no sync loads
                worker.wait_for_save()
                holder.results = worker.get_transfer_results(finished or set())
                worker.clear_connector_metadata()


def request(rid: str, prompt: list[int], params: dict[str, Any] | None) -> Any:
    return NS(
        request_id=rid,
        prompt_token_ids=prompt,
        kv_transfer_params=params,
        status=None,
    )


def scheduled(rid: str, tokens: int, blocks: list[int]) -> Any:
    """A scheduler output with ``rid`` scheduled whole (its prompt in this step)."""
    step = idle()
    step.scheduled_new_reqs = [NS(req_id=rid, num_computed_tokens=0, block_ids=(blocks,))]
    step.num_scheduled_tokens = {rid: tokens}
    return step


def idle() -> Any:
    """A scheduler output with nothing scheduled (the engine steps only for its transfers)."""
    return NS(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        finished_req_ids=set(),
    )


_ids = itertools.count()


@dataclass
class Prefill:
    rid: str
    prompt: list[int]
    meta: Any
    params: dict[str, Any] | None = None


def plan_prefill(producer: Engine, tokens: int) -> Prefill:
    """Scheduler side of a prefill with ``do_remote_decode``: the step's metadata."""
    rid = f"prefill-{next(_ids)}"
    prompt = list(range(tokens))
    req = request(rid, prompt, {"do_remote_decode": True})
    assert producer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = producer.allocate(rid, tokens)
    meta = producer.scheduler.build_connector_meta(scheduled(rid, tokens, blocks))
    return Prefill(rid, prompt, meta)


def plan_together(
    producer: Engine, count: int, tokens: int, *, last_chunk: int | None = None
) -> list[Prefill]:
    """``count`` prefills of ``tokens`` each whose prompts complete in one step; their
    ``meta`` is that step's. With ``last_chunk``, each was computed up to its last
    ``last_chunk`` tokens in an earlier step (run here, its saves included), as chunked
    prefill, a prefix hit or a resumed preemption leaves it: with ``last_chunk=1`` the
    finishing step schedules one token per request, a uniform decode that vLLM replays as
    a full CUDA graph (no ``save_kv_layer``; run it with no saves)."""
    prefills, new = [], []
    for _ in range(count):
        rid = f"prefill-{next(_ids)}"
        base = 1000 * next(_ids)
        prompt = list(range(base, base + tokens))  # distinct prompts, distinct digests
        req = request(rid, prompt, {"do_remote_decode": True})
        assert producer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        blocks = producer.allocate(rid, tokens)
        new.append(NS(req_id=rid, num_computed_tokens=0, block_ids=(blocks,)))
        prefills.append(Prefill(rid, prompt, None))
    step = idle()
    if last_chunk is None:
        step.scheduled_new_reqs = new
        step.num_scheduled_tokens = {p.rid: tokens for p in prefills}
    else:
        first = idle()
        first.scheduled_new_reqs = new
        first.num_scheduled_tokens = {p.rid: tokens - last_chunk for p in prefills}
        early = producer.scheduler.build_connector_meta(first)
        assert not early.stores  # nothing completes in the earlier step
        with producer.step(early):
            save_layers(producer)
        step.scheduled_cached_reqs = NS(
            req_ids=[p.rid for p in prefills],
            num_computed_tokens=[tokens - last_chunk] * count,
        )
        step.num_scheduled_tokens = {p.rid: last_chunk for p in prefills}
    meta = producer.scheduler.build_connector_meta(step)
    for p in prefills:
        p.meta = meta
    return prefills


def save_layers(producer: Engine, layer_hook: Callable[[int], None] | None = None) -> None:
    """The forward's saves: ``save_kv_layer`` after each layer (after ``layer_hook(i)``, the
    layer's compute, when given)."""
    for i, name in enumerate(producer.layer_names):
        if layer_hook is not None:
            layer_hook(i)
        producer.worker.save_kv_layer(name, producer.caches[name], None)


def finish_prefill(
    producer: Engine, prefill: Prefill, status_name: str = "FINISHED_LENGTH_CAPPED"
) -> None:
    """The scheduler finishes the request after its step: it answers the transfer's params
    and keeps the blocks while the copy may be in flight."""
    req = request(prefill.rid, prefill.prompt, {"do_remote_decode": True})
    req.status = getattr(request_status(), status_name)
    delay, params = producer.scheduler.request_finished(req, producer.request_blocks[prefill.rid])
    prefill.params = params
    if delay:
        producer.finished.add(prefill.rid)
    else:
        producer.release(prefill.rid)


def poll_sent(producer: Engine, max_steps: int = 100_000) -> set[str]:
    """Idle steps until every finished request's copies have landed; their blocks go back."""
    sent: set[str] = set()
    told = set(producer.finished)
    for _ in range(max_steps):
        with producer.step(producer.scheduler.build_connector_meta(idle()), told) as s:
            pass
        told = set()
        done = s.results.finished_sending
        producer.scheduler.update_connector_output(
            NS(finished_sending=done, finished_recving=set())
        )
        for rid in done:
            producer.release(rid)
            producer.finished.discard(rid)
        sent |= done
        if not producer.finished:
            return sent
    raise RuntimeError(f"copies of {sorted(producer.finished)} never landed")


@dataclass
class Decode:
    rid: str
    blocks: list[int]
    meta: Any
    matched: tuple[int | None, bool]


def plan_decode(consumer: Engine, prefill: Prefill, sampled: int = 7) -> Decode:
    """Scheduler side of the decode: match the transfer, allocate, build the metadata."""
    assert prefill.params is not None
    rid = f"decode-{next(_ids)}"
    params = {k: v for k, v in prefill.params.items() if k != "remote_prefill_cached_tokens"}
    prompt = [*prefill.prompt, sampled]
    req = request(rid, prompt, params)
    matched = consumer.scheduler.get_num_new_matched_tokens(req, 0)
    blocks = consumer.allocate(rid, len(prompt))
    n = matched[0] or 0
    consumer.scheduler.update_state_after_alloc(req, NS(get_block_ids=lambda: (blocks,)), n)
    meta = consumer.scheduler.build_connector_meta(idle())
    return Decode(rid, blocks, meta, matched)


def run_load(consumer: Engine, decode: Decode, max_steps: int = 1) -> Any:
    """Worker steps until the load is reported (or ``max_steps``); the last step's results."""
    meta = decode.meta
    results = None
    for _ in range(max_steps):
        with consumer.step(meta) as s:
            pass
        results = s.results
        meta = consumer.scheduler.build_connector_meta(idle())
        if decode.rid in results.finished_recving:
            break
    return results


def same_kv(
    producer: Engine, prefill_blocks: list[int], consumer: Engine, decode: Decode, tokens: int
) -> bool:
    """Whether the consumer's cache now holds the producer's KV for ``tokens`` tokens."""
    bs = producer.geometry.block_size
    for name in producer.layer_names:
        src, dst = producer.caches[name], consumer.caches[name]
        for pos in range(0, tokens, max(1, tokens // 64)):  # a sample of positions, both ends
            for p in (pos, tokens - 1):
                a = src[prefill_blocks[p // bs], :, p % bs].cpu()
                b = dst[decode.blocks[p // bs], :, p % bs].cpu()
                if not torch.equal(a, b):
                    return False
    return True
