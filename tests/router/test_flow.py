"""Flow control (router/flow.py) on a fake clock: priority between classes, fairness between
tenants within a class, bounded queues that shed the sheddable first, bounded waits, and a
client that leaves while it waits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from common.policy_schema import PolicyKnobs
from router.decide import Decision, Route
from router.flow import FlowControl, Outcome, Waiter

KNOBS = PolicyKnobs()
INTERACTIVE = KNOBS.slo_class("interactive")
STANDARD = KNOBS.slo_class("standard")
BATCH = KNOBS.slo_class("batch")
DEPLOYMENT = 1
FULL = Decision(Route.REJECTED, reason="saturated", status=429, code="queue-full")


@dataclass
class Engines:
    """A deployment's room: each plan takes a slot while there is one, else is refused
    (429); records the order in which requests were let through."""

    slots: int = 0
    routed: list[str] = field(default_factory=list)

    def plan(self, name: str) -> Decision:
        if self.slots <= 0:
            return FULL
        self.slots -= 1
        self.routed.append(name)
        return Decision(Route.GPU_ONLY, reason="room", code="gpu-room")


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Recorded:
    waits: list[tuple[str, float]] = field(default_factory=list)
    depths: dict[str, int] = field(default_factory=dict)
    sheds: list[tuple[str, str]] = field(default_factory=list)

    def queue_wait(self, slo_class: str, seconds: float) -> None:
        self.waits.append((slo_class, seconds))

    def queue_depth(self, slo_class: str, depth: int) -> None:
        self.depths[slo_class] = depth

    def shed(self, slo_class: str, reason: str) -> None:
        self.sheds.append((slo_class, reason))


def flow_and_engines() -> tuple[FlowControl, Engines, Clock, Recorded]:
    clock, metrics = Clock(), Recorded()
    return FlowControl(metrics, clock=clock), Engines(), clock, metrics


def queue(
    flow: FlowControl,
    engines: Engines,
    name: str,
    slo_name: str,
    tenant: str = "t",
    bound: int = 100,
    max_wait: float = 600.0,
) -> Waiter:
    return flow.enqueue(
        DEPLOYMENT,
        KNOBS.slo_class(slo_name),
        tenant,
        lambda: engines.plan(name),
        bound=bound,
        max_wait=max_wait,
    )


def test_a_queued_interactive_request_goes_before_an_earlier_queued_batch_one() -> None:
    flow, engines, _, metrics = flow_and_engines()
    batch = queue(flow, engines, "batch-1", "batch")
    standard = queue(flow, engines, "standard-1", "standard")
    interactive = queue(flow, engines, "interactive-1", "interactive")
    assert metrics.depths == {"interactive": 1, "standard": 1, "batch": 1}
    # Saturated: nothing leaves, and the head is tried only once.
    assert flow.pump(DEPLOYMENT) == 0
    assert all(w.waiting for w in (batch, standard, interactive))
    engines.slots = 1
    assert flow.pump(DEPLOYMENT) == 1
    assert engines.routed == ["interactive-1"]
    assert interactive.outcome is Outcome.ROUTED and interactive.decision is not None
    assert interactive.decision.route is Route.GPU_ONLY
    assert batch.waiting and standard.waiting
    engines.slots = 5
    flow.pump(DEPLOYMENT)
    assert engines.routed == ["interactive-1", "standard-1", "batch-1"]
    assert flow.queued == 0 and metrics.depths == {"interactive": 0, "standard": 0, "batch": 0}
    assert sorted(c for c, _ in metrics.waits) == ["batch", "interactive", "standard"]


def test_a_waiting_class_holds_back_arrivals_of_its_priority_and_below_only() -> None:
    flow, engines, _, _ = flow_and_engines()
    assert not flow.ahead(DEPLOYMENT, BATCH)
    queue(flow, engines, "standard-1", "standard")
    assert flow.ahead(DEPLOYMENT, BATCH)
    assert flow.ahead(DEPLOYMENT, STANDARD)
    assert not flow.ahead(DEPLOYMENT, INTERACTIVE)  # a higher class may overtake
    assert not flow.ahead(DEPLOYMENT + 1, BATCH)  # another deployment's queues are apart


def test_one_tenants_flood_does_not_starve_another_tenants_single_request() -> None:
    flow, engines, _, _ = flow_and_engines()
    # Tenant a's flood: its first requests were routed without waiting, the rest wait.
    for _ in range(3):
        flow.served(DEPLOYMENT, "standard", "a")
    flood = [queue(flow, engines, f"a-{i}", "standard", tenant="a") for i in range(10)]
    steady = queue(flow, engines, "b-0", "standard", tenant="b")
    engines.slots = 1
    flow.pump(DEPLOYMENT)
    assert engines.routed == ["b-0"]
    assert steady.outcome is Outcome.ROUTED and all(w.waiting for w in flood)
    # Then the tenants alternate: a's next, then b's next, then a's again.
    more = [queue(flow, engines, f"b-{i}", "standard", tenant="b") for i in (1, 2)]
    engines.slots = 4
    flow.pump(DEPLOYMENT)
    assert engines.routed == ["b-0", "a-0", "b-1", "a-1", "b-2"]
    assert all(w.outcome is Outcome.ROUTED for w in more)


def test_without_history_the_tenants_take_turns_from_the_first_arrival() -> None:
    flow, engines, _, _ = flow_and_engines()
    for i in range(10):
        queue(flow, engines, f"a-{i}", "batch", tenant="a")
    queue(flow, engines, "b-0", "batch", tenant="b")
    engines.slots = 3
    flow.pump(DEPLOYMENT)
    assert engines.routed == ["a-0", "b-0", "a-1"]


def test_full_queues_shed_the_newest_batch_request_for_an_interactive_arrival() -> None:
    flow, engines, _, metrics = flow_and_engines()
    standard = queue(flow, engines, "standard-1", "standard", bound=3)
    older = queue(flow, engines, "batch-1", "batch", bound=3)
    newer = queue(flow, engines, "batch-2", "batch", bound=3)
    woken: list[Waiter] = []
    newer.wake = lambda: woken.append(newer)
    interactive = queue(flow, engines, "interactive-1", "interactive", bound=3)
    assert interactive.waiting
    assert newer.outcome is Outcome.SHED and newer.reason == "evicted" and woken == [newer]
    assert older.waiting and standard.waiting
    assert metrics.sheds == [("batch", "evicted")]
    # A sheddable arrival at full queues is shed itself; so is one that may not be shed when
    # nothing sheddable is left to make room.
    batch = queue(flow, engines, "batch-3", "batch", bound=3)
    assert batch.outcome is Outcome.SHED and batch.reason == "queue-full"
    queue(flow, engines, "interactive-2", "interactive", bound=3)  # evicts batch-1
    assert older.outcome is Outcome.SHED and older.reason == "evicted"
    refused = queue(flow, engines, "standard-2", "standard", bound=3)
    assert refused.outcome is Outcome.SHED and refused.reason == "queue-full"
    assert metrics.sheds == [
        ("batch", "evicted"),
        ("batch", "queue-full"),
        ("batch", "evicted"),
        ("standard", "queue-full"),
    ]
    assert flow.queued == 3 and metrics.depths == {"interactive": 2, "standard": 1, "batch": 0}


def test_a_flooding_tenant_cannot_lock_another_out_of_full_queues() -> None:
    flow, engines, _, metrics = flow_and_engines()
    flood = [queue(flow, engines, f"a-{i}", "standard", tenant="a", bound=4) for i in range(4)]
    # b's arrivals each take the place of a's newest request while a holds two or more
    # requests more than b would.
    first = queue(flow, engines, "b-0", "standard", tenant="b", bound=4)
    assert first.waiting and flood[3].outcome is Outcome.SHED
    assert flood[3].reason == "fair-share"
    second = queue(flow, engines, "b-1", "standard", tenant="b", bound=4)
    assert second.waiting and flood[2].reason == "fair-share"
    third = queue(flow, engines, "b-2", "standard", tenant="b", bound=4)
    assert third.outcome is Outcome.SHED and third.reason == "queue-full"  # 2 and 2: even
    assert flood[0].waiting and flood[1].waiting
    # A lower class never takes a higher class's place.
    batch = queue(flow, engines, "c-0", "batch", tenant="c", bound=4)
    assert batch.outcome is Outcome.SHED and batch.reason == "queue-full"
    assert metrics.sheds.count(("standard", "fair-share")) == 2


def test_a_bound_of_zero_queues_nothing() -> None:
    flow, engines, _, _ = flow_and_engines()
    waiter = queue(flow, engines, "interactive-1", "interactive", bound=0)
    assert waiter.outcome is Outcome.SHED and waiter.reason == "queue-full"
    assert flow.queued == 0


def test_a_wait_past_its_limit_is_shed_as_a_timeout() -> None:
    flow, engines, clock, metrics = flow_and_engines()
    batch = queue(flow, engines, "batch-1", "batch", max_wait=BATCH.ttft_ms / 1000)
    standard = queue(flow, engines, "standard-1", "standard", max_wait=600)
    clock.now += BATCH.ttft_ms / 1000 - 0.5
    flow.tick()
    assert batch.waiting
    clock.now += 1.0
    flow.tick()
    assert batch.outcome is Outcome.SHED and batch.reason == "timeout"
    assert standard.waiting
    assert ("batch", "timeout") in metrics.sheds
    assert ("batch", pytest.approx(BATCH.ttft_ms / 1000 + 0.5)) in metrics.waits


def test_a_client_that_leaves_leaves_its_queue() -> None:
    flow, engines, _, metrics = flow_and_engines()
    first = queue(flow, engines, "a", "standard")
    second = queue(flow, engines, "b", "standard")
    flow.remove(first)
    assert first.outcome is Outcome.GONE and flow.queued == 1
    assert metrics.depths["standard"] == 1
    engines.slots = 5
    flow.pump(DEPLOYMENT)
    assert engines.routed == ["b"] and second.outcome is Outcome.ROUTED


def test_a_plan_that_raises_fails_its_request_only() -> None:
    flow, engines, _, _ = flow_and_engines()

    def broken() -> Decision:
        raise RuntimeError("policy gone")

    bad = flow.enqueue(DEPLOYMENT, INTERACTIVE, "t", broken, bound=10, max_wait=60)
    good = queue(flow, engines, "b", "standard")
    engines.slots = 1
    flow.pump(DEPLOYMENT)
    assert bad.outcome is Outcome.FAILED and isinstance(bad.error, RuntimeError)
    assert good.outcome is Outcome.ROUTED


def test_waiting_requests_are_woken_by_the_ticker_and_a_cancelled_one_leaves() -> None:
    async def scenario() -> None:
        metrics = Recorded()
        flow = FlowControl(metrics, tick_seconds=0.01)
        engines = Engines()
        routed = queue(flow, engines, "routed", "interactive")
        gone = queue(flow, engines, "gone", "standard")
        waiting = asyncio.create_task(flow.wait(routed))
        leaving = asyncio.create_task(flow.wait(gone))
        await asyncio.sleep(0.05)
        assert not waiting.done() and flow.queued == 2
        leaving.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert gone.outcome is Outcome.GONE and flow.queued == 1
        engines.slots = 1  # the engines have room again: the next tick routes it
        await asyncio.wait_for(waiting, 1.0)
        assert routed.outcome is Outcome.ROUTED and engines.routed == ["routed"]
        await flow.close()

    asyncio.run(scenario())
