"""Priority scheduling (vLLM's ``--scheduling-policy priority``): the batch scheduler's order
and victims, and the server's 400 for a priority it does not schedule by."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.presets import device_preset, model_preset
from sim.engine import EngineConfig, SimEngine, build_scheduler, plan_capacity
from sim.perfmodel import effective_hardware
from sim.scheduler import BatchScheduler, SchedulerConfig, Sequence
from sim.server import ServerSettings, SimServer
from sim.tokens import TokenModel

MODEL = "qwen2.5-7b-instruct"


def scheduler(policy: str, *, num_blocks: int = 1000, max_num_seqs: int = 8) -> BatchScheduler:
    device = device_preset("a10-24gb")
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        num_blocks=num_blocks,
        num_swap_blocks=0,
        watermark=0.0,
        policy=policy,
    )
    return BatchScheduler(
        config, effective_hardware(device), model_preset(MODEL), TokenModel(0), 1e9
    )


def seq(name: str, arrival: float, priority: int = 0, prompt: int = 16, new: int = 64) -> Sequence:
    return Sequence(name, prompt, new, arrival=arrival, priority=priority)


def admitted(sched: BatchScheduler, now: float = 10.0) -> list[str]:
    step = sched.plan(now)
    assert step is not None
    return [s.request_id for s, _ in step.scheduled]


def test_a_later_high_priority_request_is_admitted_before_an_earlier_low_one() -> None:
    sched = scheduler("priority", max_num_seqs=1)
    sched.add(seq("batch", 1.0, priority=2))
    sched.add(seq("interactive", 2.0, priority=0))
    assert [s.request_id for s in sched.waiting] == ["interactive", "batch"]
    assert admitted(sched) == ["interactive"]


def test_equal_priorities_keep_arrival_order_and_fcfs_ignores_priority() -> None:
    for policy in ("priority", "fcfs"):
        sched = scheduler(policy, max_num_seqs=3)
        for i, name in enumerate(("a", "b", "c")):
            sched.add(seq(name, float(i), priority=0 if policy == "priority" else 2 - i))
        assert admitted(sched) == ["a", "b", "c"], policy


def test_fcfs_plans_are_unchanged_by_priorities_it_does_not_use() -> None:
    """FCFS must not move an existing result: the same steps whatever the priorities."""

    def run(priorities: list[int]) -> list[tuple[list[str], int]]:
        sched = scheduler("fcfs", num_blocks=12, max_num_seqs=4)
        for i, p in enumerate(priorities):
            sched.add(seq(str(i), float(i), priority=p, prompt=40, new=40))
        out: list[tuple[list[str], int]] = []
        now = 0.0
        while sched.has_work() and len(out) < 200:
            step = sched.plan(now)
            if step is None:
                break
            now += step.duration
            out.append(([s.request_id for s, _ in step.scheduled], step.preempted))
            sched.complete(step, now)
        return out

    plain = run([0, 0, 0, 0, 0])
    assert plain == run([3, 1, 4, 1, 5])
    assert any(preempted for _, preempted in plain)  # the case exercises preemption


def fill(sched: BatchScheduler, specs: list[tuple[str, float, int]]) -> None:
    """Run the sequences' prefills so they all decode, with blocks exactly full."""
    for name, arrival, priority in specs:
        sched.add(seq(name, arrival, priority=priority, prompt=16, new=64))
    step = sched.plan(0.0)
    assert step is not None and len(step.scheduled) == len(specs)
    sched.complete(step, step.duration)


def test_out_of_blocks_the_lowest_priority_latest_arrival_is_preempted_first() -> None:
    sched = scheduler("priority", num_blocks=4, max_num_seqs=4)
    # Four sequences of one 16-token block each; the next decode step needs a block each.
    fill(sched, [("i-early", 0.0, 0), ("b-early", 0.1, 2), ("b-late", 0.2, 2), ("i-late", 0.3, 0)])
    step = sched.plan(1.0)
    assert step is not None
    left = [s.request_id for s, _ in step.scheduled]
    assert left == ["i-early", "i-late"]
    assert [s.request_id for s in sched.waiting] == ["b-early", "b-late"]
    assert step.preempted == 2


def test_fcfs_preempts_the_last_admitted_whatever_its_priority() -> None:
    sched = scheduler("fcfs", num_blocks=4, max_num_seqs=4)
    fill(sched, [("i-early", 0.0, 0), ("b-early", 0.1, 2), ("b-late", 0.2, 2), ("i-late", 0.3, 0)])
    step = sched.plan(1.0)
    assert step is not None
    assert [s.request_id for s, _ in step.scheduled] == ["i-early", "b-early"]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        scheduler("lottery")


async def _post(policy: str, body: dict[str, Any], tmp: Path) -> tuple[int, dict[str, Any]]:
    config = EngineConfig(
        device_preset("a10-24gb"),
        model_preset(MODEL),
        MODEL,
        "prio",
        speed=50.0,
        max_model_len=2048,
        scheduling_policy=policy,
    )
    settings = ServerSettings(
        host="127.0.0.1", metrics_mode="both", shm_dir=tmp, kv_lease_seconds=30
    )
    app: web.Application = SimServer(SimEngine(config), settings).app()
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/v1/completions", json={"model": MODEL, **body})
        return response.status, await response.json()


@pytest.mark.process  # the engine's timer looks its C library up with ldconfig
def test_a_priority_without_priority_scheduling_is_a_400_as_vllm(tmp_path: Path) -> None:
    status, body = asyncio.run(
        _post("fcfs", {"prompt": "a b c", "max_tokens": 2, "priority": 2}, tmp_path)
    )
    assert status == 400
    assert body["error"]["message"] == "Got priority 2 but Priority scheduling is not enabled."
    assert body["error"]["type"] == "BadRequestError"
    # Priority 0 is every request's default, and fine under FCFS.
    status, _ = asyncio.run(
        _post("fcfs", {"prompt": "a b c", "max_tokens": 2, "priority": 0}, tmp_path)
    )
    assert status == 200


@pytest.mark.process
def test_priority_scheduling_serves_a_prioritised_request(tmp_path: Path) -> None:
    status, body = asyncio.run(
        _post("priority", {"prompt": "a b c", "max_tokens": 2, "priority": 2}, tmp_path)
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2


def test_engine_config_carries_the_policy_to_the_scheduler() -> None:
    config = EngineConfig(device_preset("a10-24gb"), model_preset(MODEL), MODEL, "t")
    hw = effective_hardware(config.device)
    prio = replace(config, scheduling_policy="priority")
    built = build_scheduler(prio, plan_capacity(prio), hw, TokenModel(0))
    assert built.config.policy == "priority"
