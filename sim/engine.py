"""The asyncio engine: drives the batch scheduler against the wall clock.

One loop per process. Each step is planned, slept once (a single timer for the whole batch,
however many streams it holds), and its tokens are then written to every stream in one pass
before any bookkeeping, so emission stays close to the modelled time even with hundreds of
streams. Sim time runs ``speed`` times faster than wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from common.kv_events import KVEventsConfig
from common.presets import GIB, DevicePreset, ModelPreset
from sim.perfmodel import (
    EffectiveHardware,
    device_memory_total_bytes,
    device_memory_used_bytes,
    effective_hardware,
    kv_capacity_bytes,
)
from sim.scheduler import BatchScheduler, SchedulerConfig, Sequence
from sim.stats import BusyMeter, EngineStats, RequestRing
from sim.timer import PreciseTimer
from sim.tokens import TokenModel

if TYPE_CHECKING:
    from sim.kv_events import KvEventPublisher

log = logging.getLogger("sim")

# The kernel wakes a sleeping process ~0.1-0.2 ms late; the engine spins up to this long.
SPIN_MAX_S = 0.0004
# Past this lag the engine stops catching up and restarts its timeline from now.
RESYNC_LAG_S = 0.050


class Sink(Protocol):
    def on_token(self, seq: Sequence, token: int) -> bool:
        """Deliver one token id now; False if the client has gone."""

    def on_finish(self, seq: Sequence) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    device: DevicePreset
    model: ModelPreset
    served_model_name: str
    engine_id: str
    speed: float = 1.0
    seed: int = 0
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    kv_cache_space_gb: float = 4.0
    swap_space_gb: float = 4.0
    preemption_mode: str = "recompute"
    # vLLM's --scheduling-policy: "fcfs", or "priority" (requests carry a ``priority``).
    scheduling_policy: str = "fcfs"
    # sysHAX-compatible mode (--syshax-compat): the patched V0 engine's flags and request fields.
    syshax_compat: bool = False
    block_size: int = 16
    # vLLM's --enable-prefix-caching (on by default in vLLM's V1 engine): sim/prefix_cache.py.
    enable_prefix_caching: bool = True
    # vLLM's --kv-events-config: the prefix cache's block events, published (sim/kv_events.py).
    kv_events: KVEventsConfig | None = None
    ring_size: int = 4096
    # vLLM's API server turns each output into an SSE chunk in Python, one request after
    # another (pydantic model, JSON, write): an estimated ~20 us per token per stream.
    output_token_overhead_s: float = 20e-6


@dataclass(frozen=True)
class Capacity:
    kv_bytes: float
    num_blocks: int
    max_model_len: int


def plan_capacity(config: EngineConfig) -> Capacity:
    """KV blocks and the usable max_model_len (clipped so one sequence always fits)."""
    kv_bytes = kv_capacity_bytes(
        config.device,
        config.model,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_space_bytes=config.kv_cache_space_gb * GIB,
        tensor_parallel_size=config.tensor_parallel_size,
    )
    block_bytes = config.model.kv_bytes_per_token * config.block_size
    num_blocks = int(kv_bytes // block_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"no room for a KV cache: {config.device.name} with {config.model.name} "
            f"(weights {config.model.weight_bytes / GIB:.1f} GiB) leaves {kv_bytes / GIB:.2f} GiB"
        )
    wanted = config.max_model_len or config.model.max_position
    fits = num_blocks * config.block_size
    return Capacity(kv_bytes=kv_bytes, num_blocks=num_blocks, max_model_len=min(wanted, fits))


def build_scheduler(
    config: EngineConfig, capacity: Capacity, hw: EffectiveHardware, token_model: TokenModel
) -> BatchScheduler:
    swap_blocks = int(
        config.swap_space_gb * GIB // (config.model.kv_bytes_per_token * config.block_size)
    )
    return BatchScheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            # vLLM's chunked-prefill budget: at least 8192, enough for a whole long prompt.
            max_num_batched_tokens=config.max_num_batched_tokens
            or max(8192, min(capacity.max_model_len, 65536)),
            num_blocks=capacity.num_blocks,
            num_swap_blocks=swap_blocks,
            block_size=config.block_size,
            preemption_mode=config.preemption_mode,
            policy=config.scheduling_policy,
            prefix_caching=config.enable_prefix_caching,
            kv_events=config.kv_events is not None and config.kv_events.publishes,
            output_token_s=config.output_token_overhead_s,
        ),
        hw,
        config.model,
        token_model,
        config.device.swap_bandwidth,
    )


class SimEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.capacity = plan_capacity(config)
        if self.capacity.max_model_len < (config.max_model_len or config.model.max_position):
            log.warning(
                "max_model_len clipped to %d: the KV cache holds only that many tokens",
                self.capacity.max_model_len,
            )
        self.hw: EffectiveHardware = effective_hardware(config.device, config.tensor_parallel_size)
        self.token_model = TokenModel(config.seed)
        self.scheduler = build_scheduler(config, self.capacity, self.hw, self.token_model)
        self.stats = EngineStats()
        self.busy = BusyMeter()
        self.ring = RequestRing(config.ring_size)
        self.speed = config.speed
        self._t0 = time.monotonic()
        self._epoch0 = time.time()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._timer = PreciseTimer()
        self.late_steps = 0
        self.kv_publisher: KvEventPublisher | None = None

    # -- clocks ---------------------------------------------------------------------------

    def sim_now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def wall_of(self, sim: float) -> float:
        return self._t0 + sim / self.speed

    def epoch_of(self, sim: float) -> float:
        return self._epoch0 + sim / self.speed

    def device_usage(self) -> dict[str, float | int]:
        """What the modelled device is doing, for an agent's heartbeat (docs/simulator.md).

        Times are simulated seconds, so ``busy / uptime`` deltas give the utilisation whatever
        ``--speed`` is.
        """
        now = self.sim_now()
        sched = self.scheduler
        blocks_in_use = sched.config.num_blocks - sched.free_blocks
        used = device_memory_used_bytes(self.config.model, blocks_in_use * self.config.block_size)
        return {
            "busy_seconds_total": self.busy.busy_at(now),
            "uptime_seconds": now,
            "memory_used_bytes": int(used),
            "memory_total_bytes": device_memory_total_bytes(
                self.config.device, self.config.tensor_parallel_size
            ),
            "kv_blocks_in_use": blocks_in_use,
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }

    # -- requests -------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        seq.arrival = self.sim_now()
        self.scheduler.add(seq)
        self._wake.set()

    def start(self) -> None:
        # Move everything allocated so far out of the collector's sight: fewer and shorter
        # full collections, which would otherwise stall token emission for milliseconds.
        if self.scheduler.cache is not None and self.scheduler.cache.record_events:
            assert self.config.kv_events is not None
            # lazy: pyzmq only where events are published
            from sim.kv_events import KvEventPublisher

            self.kv_publisher = KvEventPublisher(self.config.kv_events, self.config.block_size)
        gc.collect()
        gc.freeze()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._timer.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()

    # -- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        scheduler = self.scheduler
        step_start: float | None = None
        while True:
            if not scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                step_start = None
                continue
            now = self.sim_now()
            if step_start is None or now - step_start > RESYNC_LAG_S * self.speed:
                if step_start is not None:
                    self.late_steps += 1
                step_start = now
            step = scheduler.plan(step_start)
            if step is None:
                await self._wait_for_ready(scheduler.next_ready_at())
                step_start = None
                continue
            end = step_start + step.duration
            self.busy.begin(step_start, end)
            # Sample the step's tokens before sleeping, so that only the socket writes remain
            # at the deadline.
            result = scheduler.complete(step, end)
            # The first token is due at the step's end, or later if the frontend is still
            # busy with earlier steps' outputs.
            first = result.emitted[0][0].token_times[-1] if result.emitted else end
            # Busy-wait the last stretch (at most 5% of the step) for precision.
            spin = min(SPIN_MAX_S, 0.05 * step.duration / self.speed)
            await self._timer.sleep_until(self.wall_of(first), spin)
            self._emit(result.emitted, self.wall_of(first))
            for seq in result.finished:
                seq.sink.on_finish(seq)
            self._account(result.emitted, result.finished, step.prefill_tokens, end)
            if self.kv_publisher is not None:
                self._publish_kv_events()
            self.busy.finish()
            step_start = end

    def _publish_kv_events(self) -> None:
        """The step's prefix cache events, as one batch (vLLM publishes one per step)."""
        assert self.kv_publisher is not None and self.scheduler.cache is not None
        recorded = self.scheduler.cache.take_events()
        if recorded:
            self.kv_publisher.publish(recorded)

    async def _wait_for_ready(self, ready_at: float | None) -> None:
        self._wake.clear()
        timeout = None if ready_at is None else max(0.0, self.wall_of(ready_at) - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _emit(self, emitted: list[tuple[Sequence, int]], start_wall: float) -> None:
        """Write each token at its modelled time: the k-th output of a step k frontend
        costs after the first (see ``output_token_overhead_s``)."""
        gone: list[Sequence] = []
        spacing = self.config.output_token_overhead_s / self.speed
        clock = time.monotonic
        for k, (seq, token) in enumerate(emitted):
            target = start_wall + k * spacing
            while clock() < target:
                pass  # microseconds: the writes themselves take most of the spacing
            if not seq.sink.on_token(seq, token):
                gone.append(seq)
        for seq in gone:
            if seq.finish_reason is None:
                self.scheduler.abort(seq)
                seq.sink.on_finish(seq)

    def _account(
        self,
        emitted: list[tuple[Sequence, int]],
        finished: list[Sequence],
        prompt_tokens: int,
        end: float,
    ) -> None:
        stats = self.stats
        for seq, _ in emitted:
            times = seq.token_times
            if len(times) == 1:
                stats.count_prompt(seq)
                stats.ttft.observe(end - seq.arrival)
            else:
                stats.itl.observe(times[-1] - times[-2])
        stats.generation_tokens_total += len(emitted)
        stats.record_step(end, prompt_tokens, len(emitted))
        for seq in finished:
            stats.e2e.observe(end - seq.arrival)
            reason = seq.finish_reason.value if seq.finish_reason else "abort"
            stats.requests_finished[reason] = stats.requests_finished.get(reason, 0) + 1
            self.ring.add(self.timing_record(seq))

    def timing_record(self, seq: Sequence) -> dict[str, Any]:
        epoch = self.epoch_of
        return {
            "request_id": seq.request_id,
            "received_at": epoch(seq.arrival),
            "first_token_at": None if seq.first_token_at is None else epoch(seq.first_token_at),
            "finished_at": epoch(seq.last_token_at if seq.last_token_at else seq.arrival),
            # Packed doubles: a full ring of long outputs as Python float lists would take
            # hundreds of MB. /sim/requests unpacks them.
            "token_times": array("d", [epoch(t) for t in seq.token_times]),
            "emitted_times": array("d", getattr(seq.sink, "emitted_times", [])),
            "prompt_tokens": seq.prompt_tokens + seq.resumed_tokens,
            "completion_tokens": seq.generated,
            "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
            "preemptions": seq.preemptions,
        }
