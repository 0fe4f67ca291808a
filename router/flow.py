"""Flow control: requests that wait in the router while their deployment is saturated.

When the decider turns a request away because every device of its deployment is saturated
(a 429: ``queue-full`` and its kin), the request waits here instead, in its SLO class's
queue on that deployment, and is planned again whenever a request on the deployment ends
and on every tick (``TICK_SECONDS``), until it is routed, shed, or its wait runs out
(docs/slo-classes.md, "Flow control"):

- **priority between classes**: the queue of the class with the lowest ``<class>_priority``
  is served first; while requests of a class wait, an arrival of that class or a lower one
  waits behind them (no overtaking);
- **fairness between tenants within a class**: of the tenants with a request waiting in a
  class, the one served least recently on the deployment goes first (a request routed
  without waiting counts as served too), so one tenant's flood does not starve another
  tenant's steady requests;
- **bounded queues, sheddable classes shed first**: a deployment's queues hold at most the
  policy's ``max_queue_size`` requests together. An arrival at full queues is turned away
  (``queue-full``) unless it is of a class that may not be shed and a request of a sheddable
  class waits: the newest of those (of the lowest-priority class) is shed (``evicted``) to
  make room. Failing that, where another tenant holds more of the queues than the
  arrival's tenant would (by two or more), that tenant's newest request of the arrival's
  class or a lower one is shed instead (``fair-share``): a flood cannot fill the queues and
  lock the other tenants out;
- **bounded waits**: a sheddable class waits at most its TTFT target, the others at most
  ``request_timeout_seconds`` (``timeout``).

The queues are plain data driven by a clock, so the tests run them with fake time; the
asyncio side is ``FlowControl.wait`` and the ticker task it starts while anything waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

from common.policy_schema import SLO_CLASSES, SloClass
from router.decide import Code, Decision, Route
from router.metrics import SHED_REASONS

# How often waiting requests are planned again besides when a request on their deployment
# ends (the engines' load changes with every scrape and every request the router sends).
TICK_SECONDS = 0.1
__all__ = ["SHED_REASONS", "FlowControl", "Outcome", "Waiter", "must_wait"]


class Outcome(StrEnum):
    ROUTED = "routed"  # planned again and taken: ``decision`` says where
    SHED = "shed"  # turned away: ``reason`` is one of SHED_REASONS
    GONE = "gone"  # the client left while it waited
    FAILED = "failed"  # planning it raised ``error``


class FlowMetrics(Protocol):
    """What the queues report (``router.metrics.RouterMetrics``)."""

    def queue_wait(self, slo_class: str, seconds: float) -> None: ...

    def queue_depth(self, slo_class: str, depth: int) -> None: ...

    def shed(self, slo_class: str, reason: str) -> None: ...


def must_wait(decision: Decision) -> bool:
    """Whether a decision means "saturated, try again soon" (a 429), not "cannot serve"."""
    return decision.route is Route.REJECTED and decision.status == 429


@dataclass(eq=False)
class Waiter:
    """One request in (or turned away at) a deployment's queues."""

    deployment: int
    slo: SloClass
    tenant: str
    arrived: float
    # When its wait runs out (monotonic, the flow control's clock).
    deadline: float
    # Arrival order, across every queue.
    order: int
    # Plans the request again on its deployment (``router.plan.plan``).
    plan: Callable[[], Decision]
    outcome: Outcome | None = None
    decision: Decision | None = None
    reason: Code | Literal[""] = ""
    error: BaseException | None = None
    # Wakes the request's task when it leaves the queues (set by ``FlowControl.wait``).
    wake: Callable[[], None] | None = None

    @property
    def waiting(self) -> bool:
        return self.outcome is None


@dataclass
class _Deployment:
    """The queues of one deployment: per class, per tenant, in arrival order."""

    queues: dict[str, dict[str, deque[Waiter]]] = field(default_factory=dict)
    total: int = 0
    # (class, tenant) -> when it was last served (a stamp of FlowControl's counter).
    served: dict[tuple[str, str], int] = field(default_factory=dict)

    def waiters(self) -> list[Waiter]:
        return [w for tenants in self.queues.values() for q in tenants.values() for w in q]

    def class_head(self, name: str) -> Waiter | None:
        """The next request of class ``name``: the head of the tenant served least recently
        (never served first), then the one that arrived first."""
        best: Waiter | None = None
        best_key: tuple[int, int] = (0, 0)
        for tenant, queue in self.queues.get(name, {}).items():
            if not queue:
                continue
            head = queue[0]
            key = (self.served.get((name, tenant), -1), head.order)
            if best is None or key < best_key:
                best, best_key = head, key
        return best

    def head(self) -> Waiter | None:
        """The next request to plan: the head of the class with the lowest priority value
        (ties: the earlier arrival)."""
        heads = [h for name in self.queues if (h := self.class_head(name)) is not None]
        return min(heads, key=lambda w: (w.slo.priority, w.order), default=None)

    def add(self, waiter: Waiter) -> None:
        tenants = self.queues.setdefault(waiter.slo.name, {})
        tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self.total += 1

    def discard(self, waiter: Waiter) -> bool:
        queue = self.queues.get(waiter.slo.name, {}).get(waiter.tenant)
        if queue is None:
            return False
        try:
            queue.remove(waiter)
        except ValueError:
            return False
        if not queue:
            del self.queues[waiter.slo.name][waiter.tenant]
        self.total -= 1
        return True


def _newest(waiter: Waiter) -> tuple[int, int]:
    """Sort key: the lowest-priority class last, and within it the latest arrival."""
    return (waiter.slo.priority, waiter.order)


class FlowControl:
    """Every deployment's class queues; one per router (``Router.flow``)."""

    def __init__(
        self,
        metrics: FlowMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        tick_seconds: float = TICK_SECONDS,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.tick_seconds = tick_seconds
        self.deployments: dict[int, _Deployment] = {}
        self.depth: dict[str, int] = dict.fromkeys(SLO_CLASSES, 0)
        self._order = itertools.count()
        self._stamps = itertools.count()
        self._ticker: asyncio.Task[None] | None = None

    # -- questions ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return sum(d.total for d in self.deployments.values())

    def waiters(self, deployment: int) -> list[Waiter]:
        """The requests waiting on ``deployment``, in no particular order."""
        queues = self.deployments.get(deployment)
        return queues.waiters() if queues is not None else []

    def ahead(self, deployment: int, slo: SloClass) -> bool:
        """Whether requests of ``slo``'s priority or a higher one wait on ``deployment``: an
        arrival of ``slo`` then waits behind them instead of overtaking."""
        queues = self.deployments.get(deployment)
        if queues is None or not queues.total:
            return False
        return any(w.slo.priority <= slo.priority for w in queues.waiters())

    # -- arrivals, departures ---------------------------------------------------------------

    def served(self, deployment: int, slo_class: str, tenant: str) -> None:
        """A request of ``tenant`` and ``slo_class`` was routed on ``deployment`` (queued or
        not): its tenant goes behind the others of its class there."""
        queues = self.deployments.setdefault(deployment, _Deployment())
        queues.served[(slo_class, tenant)] = next(self._stamps)

    def enqueue(
        self,
        deployment: int,
        slo: SloClass,
        tenant: str,
        plan: Callable[[], Decision],
        *,
        bound: int,
        max_wait: float,
    ) -> Waiter:
        """Queue a request that cannot be routed now. At full queues (``bound`` requests on
        the deployment) it is shed at once (outcome SHED, ``queue-full``) unless its class
        may not be shed and a sheddable request waits, which is shed in its place."""
        now = self.clock()
        waiter = Waiter(deployment, slo, tenant, now, now + max_wait, next(self._order), plan)
        queues = self.deployments.setdefault(deployment, _Deployment())
        if queues.total >= bound:
            victim = self._victim(queues, slo, tenant)
            if victim is None:
                waiter.outcome, waiter.reason = Outcome.SHED, Code.QUEUE_FULL
                if self.metrics is not None:
                    self.metrics.shed(slo.name, Code.QUEUE_FULL)
                return waiter
            self._leave(queues, victim, Outcome.SHED, reason=victim.reason)
        queues.add(waiter)
        self._set_depth(slo.name, +1)
        return waiter

    @staticmethod
    def _victim(queues: _Deployment, slo: SloClass, tenant: str) -> Waiter | None:
        """The waiting request shed to make room for an arrival of ``slo`` from ``tenant``
        at full queues (its ``reason`` set), or None. Only a request of ``slo``'s priority
        or a lower one is shed: for an arrival that may not be shed, the newest request of
        the lowest-priority sheddable class (``evicted``); else the newest request of the
        tenant holding the most of the queues, where it holds at least two more than
        ``tenant`` would with the arrival (``fair-share``)."""
        waiters = queues.waiters()
        eligible = [w for w in waiters if w.slo.priority >= slo.priority]
        sheddable = [w for w in eligible if w.slo.sheddable]
        if sheddable and not slo.sheddable:
            victim = max(sheddable, key=_newest)
            victim.reason = Code.EVICTED
            return victim
        held = Counter(w.tenant for w in waiters)
        mine = held[tenant] + 1
        heavy = [w for w in eligible if w.tenant != tenant and held[w.tenant] > mine]
        if not heavy:
            return None
        most = max(held[w.tenant] for w in heavy)
        victim = max((w for w in heavy if held[w.tenant] == most), key=_newest)
        victim.reason = Code.FAIR_SHARE
        return victim

    def remove(self, waiter: Waiter) -> None:
        """The client left while ``waiter`` waited: it leaves its queue."""
        queues = self.deployments.get(waiter.deployment)
        if queues is not None and waiter.waiting:
            self._leave(queues, waiter, Outcome.GONE)

    def _leave(
        self,
        queues: _Deployment,
        waiter: Waiter,
        outcome: Outcome,
        *,
        reason: Code | Literal[""] = "",
        decision: Decision | None = None,
        error: BaseException | None = None,
    ) -> None:
        if not queues.discard(waiter):
            return
        waiter.outcome, waiter.reason = outcome, reason
        waiter.decision, waiter.error = decision, error
        self._set_depth(waiter.slo.name, -1)
        if self.metrics is not None:
            self.metrics.queue_wait(waiter.slo.name, max(0.0, self.clock() - waiter.arrived))
            if outcome is Outcome.SHED:
                self.metrics.shed(waiter.slo.name, reason)
        if waiter.wake is not None:
            waiter.wake()

    def _set_depth(self, slo_class: str, change: int) -> None:
        depth = self.depth[slo_class] = self.depth.get(slo_class, 0) + change
        if self.metrics is not None:
            self.metrics.queue_depth(slo_class, depth)

    # -- planning again -----------------------------------------------------------------

    def pump(self, deployment: int) -> int:
        """Plan the waiting requests of ``deployment`` again, in order (priority, then
        fairness), until one is still refused for saturation; returns how many left."""
        queues = self.deployments.get(deployment)
        left = 0
        while queues is not None and queues.total:
            waiter = queues.head()
            assert waiter is not None
            try:
                decision = waiter.plan()
            except Exception as exc:  # answered to its own client, never the loop's problem
                self._leave(queues, waiter, Outcome.FAILED, error=exc)
                left += 1
                continue
            if must_wait(decision):
                break
            queues.served[(waiter.slo.name, waiter.tenant)] = next(self._stamps)
            self._leave(queues, waiter, Outcome.ROUTED, decision=decision)
            left += 1
        return left

    def expire(self) -> int:
        """Shed every request whose wait ran out (``timeout``); returns how many."""
        now = self.clock()
        shed = 0
        for queues in self.deployments.values():
            for waiter in queues.waiters():
                if waiter.deadline <= now:
                    self._leave(queues, waiter, Outcome.SHED, reason=Code.TIMEOUT)
                    shed += 1
        return shed

    def tick(self) -> None:
        """One round: waits that ran out are shed, then every deployment is planned again."""
        self.expire()
        for deployment in list(self.deployments):
            self.pump(deployment)

    # -- asyncio ------------------------------------------------------------------------

    async def wait(self, waiter: Waiter) -> None:
        """Until ``waiter`` leaves the queues (routed, shed or failed). Cancelled (the client
        left, or the request's deadline), it leaves its queue."""
        if not waiter.waiting:
            return
        done = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        waiter.wake = wake
        self._start_ticker()
        try:
            await done
        finally:
            waiter.wake = None
            self.remove(waiter)

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_while_waiting())

    async def _tick_while_waiting(self) -> None:
        while self.queued:
            await asyncio.sleep(self.tick_seconds)
            self.tick()

    async def close(self) -> None:
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
