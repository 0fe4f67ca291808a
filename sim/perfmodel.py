"""The performance model: pure functions from (device, model, batch) to seconds and bytes.

A step of the engine is a roofline: it takes as long as the larger of its compute time
(FLOPs / effective FLOP/s) and its memory time (bytes read / effective bandwidth), plus a
fixed per-step overhead. Decode steps are memory-bound: every step reads all weights once
plus the KV of every running sequence, so a bigger batch shares the weight read - that is why
batching helps decode on GPUs and CPUs alike. Prefill is compute-bound: about
2 x parameters FLOPs per prompt token plus the attention over the context.

All times here are simulated seconds; the engine divides them by ``--speed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from common.presets import GIB, DevicePreset, ModelPreset

# A GPU engine keeps this much memory for activations, CUDA graphs and the allocator; vLLM's
# profiling run typically finds 1-3 GiB for a 7-32B model at max_num_seqs 256.
ACTIVATION_RESERVE_BYTES = 2 * GIB
# Communication costs of tensor parallelism: each doubling keeps this share of the ideal gain.
TP_SCALING_PER_DOUBLING = 0.9


@dataclass(frozen=True)
class EffectiveHardware:
    flops: float  # FLOP/s an engine really reaches
    bandwidth: float  # bytes/s an engine really reaches
    step_overhead_s: float


def effective_hardware(device: DevicePreset, tensor_parallel_size: int = 1) -> EffectiveHardware:
    tp = max(1, tensor_parallel_size)
    scale = tp * TP_SCALING_PER_DOUBLING ** math.log2(tp)
    return EffectiveHardware(
        flops=device.peak_flops * device.flops_efficiency * scale,
        bandwidth=device.mem_bandwidth * device.bw_efficiency * scale,
        step_overhead_s=device.step_overhead_s,
    )


def kv_capacity_bytes(
    device: DevicePreset,
    model: ModelPreset,
    *,
    gpu_memory_utilization: float,
    kv_cache_space_bytes: float,
    tensor_parallel_size: int = 1,
) -> float:
    """KV-cache bytes the engine can hold.

    An accelerator gets memory x utilisation minus weights and activations (vLLM's profiling
    rule); a CPU engine gets exactly the configured VLLM_CPU_KVCACHE_SPACE.
    """
    if device.is_cpu:
        return max(0.0, kv_cache_space_bytes)
    tp = max(1, tensor_parallel_size)
    usable = device.memory_bytes * tp * gpu_memory_utilization
    return max(0.0, usable - model.weight_bytes - ACTIVATION_RESERVE_BYTES * tp)


def device_memory_used_bytes(model: ModelPreset, kv_tokens_held: int) -> float:
    """Bytes an engine holds on its device(s): all weights plus the KV blocks in use.

    ``kv_tokens_held`` counts whole blocks (blocks in use x block size): a block is taken as
    soon as one of its tokens is. The activation reserve and the preallocated but empty KV pool
    are left out, so the figure follows the load (unlike nvidia-smi under vLLM, which shows the
    whole pool from start-up).
    """
    return model.weight_bytes + model.kv_bytes_per_token * kv_tokens_held


def device_memory_total_bytes(device: DevicePreset, tensor_parallel_size: int = 1) -> int:
    """The memory the engine's devices hold: every card of a tensor-parallel group, or the
    host RAM of a CPU engine (which does not multiply with TP ranks: they share it)."""
    if device.is_cpu:
        return device.memory_bytes
    return device.memory_bytes * max(1, tensor_parallel_size)


def attention_flops(model: ModelPreset, new_tokens: int, context_before: int) -> float:
    # QK^T and AV: 2 matmuls x 2 FLOPs per multiply-add x hidden, for every (query, key) pair.
    # The i-th new token attends to context_before + i keys.
    pairs = new_tokens * context_before + new_tokens * (new_tokens + 1) / 2
    return 4.0 * model.layers * model.hidden * pairs


def step_time(
    hw: EffectiveHardware,
    model: ModelPreset,
    *,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_count: int,
    decode_context_total: int,
) -> float:
    """Seconds for one engine step.

    ``prefill_chunks`` holds (new tokens, tokens already in the KV cache) per prefilling
    sequence; ``decode_count`` sequences each add one token with ``decode_context_total`` KV
    tokens read between them.
    """
    prefill_tokens = sum(chunk for chunk, _ in prefill_chunks)
    tokens = prefill_tokens + decode_count
    if tokens == 0:
        return 0.0
    flops = 2.0 * model.params * tokens
    flops += sum(attention_flops(model, chunk, before) for chunk, before in prefill_chunks)
    flops += 4.0 * model.layers * model.hidden * decode_context_total
    kv_read = decode_context_total + sum(before for _, before in prefill_chunks)
    bytes_moved = model.weight_bytes + model.kv_bytes_per_token * (kv_read + tokens)
    return hw.step_overhead_s + max(flops / hw.flops, bytes_moved / hw.bandwidth)


def prefill_time(hw: EffectiveHardware, model: ModelPreset, prompt_tokens: int) -> float:
    """A lone prefill of a whole prompt (the TTFT of an idle engine)."""
    return step_time(
        hw, model, prefill_chunks=[(prompt_tokens, 0)], decode_count=0, decode_context_total=0
    )


def decode_step_time(hw: EffectiveHardware, model: ModelPreset, batch: int, context: int) -> float:
    """One decode step of ``batch`` sequences that each hold ``context`` tokens."""
    return step_time(
        hw, model, prefill_chunks=[], decode_count=batch, decode_context_total=batch * context
    )


def kv_copy_time(model: ModelPreset, tokens: int, bandwidth: float) -> float:
    """Seconds to copy the KV of ``tokens`` tokens at ``bandwidth`` bytes/s."""
    return model.kv_bytes_per_token * tokens / bandwidth


def parse_cpu_list(text: str) -> set[int]:
    """'0-39,80-119' or vLLM's per-rank '0-39|40-79' -> the set of CPU ids."""
    cpus: set[int] = set()
    for part in text.replace("|", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def restrict_cpu(device: DevicePreset, cpus: set[int]) -> DevicePreset:
    """A CPU engine confined to ``cpus``: compute scales with its cores, memory bandwidth with
    the NUMA nodes they sit on (each node brings its own memory controllers)."""
    if not device.is_cpu or not cpus:
        return device
    per_node = max(1, device.cores // device.numa_nodes)
    usable = {c for c in cpus if 0 <= c < device.cores}
    if not usable:
        raise ValueError(f"none of CPUs {sorted(cpus)[:8]}... exist on {device.name}")
    nodes = {c // per_node for c in usable}
    return replace(
        device,
        peak_flops=device.peak_flops * len(usable) / device.cores,
        mem_bandwidth=device.mem_bandwidth * len(nodes) / device.numa_nodes,
        cores=len(usable),
        numa_nodes=len(nodes),
    )


UNBOUND = frozenset({"", "auto", "all", "nobind"})  # the spellings of "no binding"


def bind_cpu(device: DevicePreset, binding: str) -> DevicePreset:
    """The device a CPU engine computes on when bound by ``binding`` (``--cpu-bind``, else
    vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: the preset's core ids, ranks joined by ``|``); the
    whole preset when unbound. Raises ValueError for a list that names none of its cores."""
    binding = binding.strip()
    if not device.is_cpu or binding in UNBOUND:
        return device
    return restrict_cpu(device, parse_cpu_list(binding))
