"""The decision pipeline: every rule that picks a replica or changes a route, as named steps
in the order they run. A new rule is a step added here (docs/router.md, "The decision
pipeline").

1. ``REPLICA``: which replica of the model serves the request: its pickers in order, the
   first that answers chooses (the last always does).
2. ``NEW_REQUEST``: the route on it. The deciders run in order until one answers (the last
   always does); then every override runs in order on that verdict and may replace it.
3. ``NEXT_CHUNK``: after a CPU decode chunk, where the rest of the sequence goes.

``decide`` and ``decide_next_chunk`` run 2 and 3; the router's request path gathers an
``Ask`` from the request and its deployment (``router.plan``), the virtual-time model
(``hetero.virtual``) asks on loads alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from common.decisions import Code, ReplicaChoice
from common.policy_schema import PolicyKnobs, SloClass
from router.decide.signals import Decision, Loads
from router.decide.steps import (
    Ask,
    Decider,
    Override,
    capacity_step,
    chunk_cpu_down,
    chunk_offload_off,
    chunk_pinned,
    chunk_stays,
    class_cpu_first,
    class_stays,
    cpu_misses,
    forced_limits,
    gpu_down,
    idle_gpu,
    mode_cpu_only,
    mode_forced_pd,
    n_above_1,
    no_cpu,
    not_spliceable,
    offload_off,
    syshax_threshold_step,
)


class Replica(Protocol):
    """What the replica choice reads of a deployment."""

    def pressure(self, now: float) -> float: ...


ReplicaT = TypeVar("ReplicaT", bound=Replica)


@dataclass(frozen=True, slots=True)
class ReplicaAsk:
    """What a replica choice is about: the policy, and for each candidate replica about how
    many of the prompt's leading tokens it was sent before (``router.prefix_index``; None:
    not looked up)."""

    knobs: PolicyKnobs
    prefix_tokens: Sequence[int] | None = None


# A picker: the index of the replica chosen among several, and why; None passes to the next.
Picker = Callable[[Sequence[float], ReplicaAsk], tuple[int, Code] | None]


def prefix_hit(pressures: Sequence[float], ask: ReplicaAsk) -> tuple[int, Code] | None:
    """Under ``replica_choice: prefix``: of the replicas within ``prefix_load_slack`` of the
    least pressure, the one sent the longest prefix of the prompt, if it is at least
    ``prefix_min_tokens`` (the less pressured of equals); else passes."""
    knobs, held = ask.knobs, ask.prefix_tokens
    if knobs.replica_choice != ReplicaChoice.PREFIX or not held:
        return None
    ceiling = min(pressures) + knobs.prefix_load_slack
    best: int | None = None
    for i, tokens in enumerate(held):
        if pressures[i] > ceiling or tokens < max(1, knobs.prefix_min_tokens):
            continue
        if best is None or (tokens, -pressures[i]) > (held[best], -pressures[best]):
            best = i
    return None if best is None else (best, Code.PREFIX_HIT)


def least_loaded(pressures: Sequence[float], ask: ReplicaAsk) -> tuple[int, Code]:
    """The replica under the least pressure (the router's in-flight requests there plus the
    GPU's queue, ``Deployment.pressure``); the first of equals."""
    return pressures.index(min(pressures)), Code.LEAST_LOADED


@dataclass(frozen=True)
class Decides:
    """A decider of a pipeline: answers with the verdict, or passes (None) to the next."""

    name: str
    run: Decider


@dataclass(frozen=True)
class Overrides:
    """An override of a pipeline: may replace the verdict so far (None: it stands)."""

    name: str
    run: Override


@dataclass(frozen=True)
class Pipeline:
    """Deciders in order (the first answer is the verdict; the last always answers), then
    overrides in order (each may replace the verdict)."""

    deciders: tuple[Decides, ...]
    overrides: tuple[Overrides, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.deciders) + tuple(o.name for o in self.overrides)

    def run(self, ask: Ask) -> Decision:
        """The verdict on ``ask``."""
        return self.judge(ask)[0]

    def judge(self, ask: Ask) -> tuple[Decision, str]:
        """The verdict on ``ask``, and the name of the step that gave it."""
        verdict: Decision | None = None
        by = ""
        for decider in self.deciders:
            verdict = decider.run(ask)
            if verdict is not None:
                by = decider.name
                break
        assert verdict is not None, "the last decider always answers"
        for override in self.overrides:
            changed = override.run(ask, verdict)
            if changed is not None:
                verdict, by = changed, override.name
        return verdict, by


# -- the pipelines, in order ----------------------------------------------------------------

REPLICA: tuple[tuple[str, Picker], ...] = (
    ("prefix", prefix_hit),
    ("least-loaded", least_loaded),
)

NEW_REQUEST = Pipeline(
    deciders=(
        Decides("mode-cpu-only", mode_cpu_only),
        Decides("gpu-down", gpu_down),
        Decides("offload-off", offload_off),
        Decides("mode-forced-pd", mode_forced_pd),
        Decides("syshax-threshold", syshax_threshold_step),
        Decides("class-cpu-first", class_cpu_first),
        Decides("capacity", capacity_step),
    ),
    overrides=(
        Overrides("n-above-1", n_above_1),
        Overrides("no-cpu", no_cpu),
        Overrides("not-spliceable", not_spliceable),
        Overrides("forced-limits", forced_limits),
    ),
)

NEXT_CHUNK = Pipeline(
    deciders=(
        Decides("cpu-down", chunk_cpu_down),
        Decides("pinned", chunk_pinned),
        Decides("offload-off", chunk_offload_off),
        Decides("cpu-misses", cpu_misses),
        Decides("class-stays", class_stays),
        Decides("idle-gpu", idle_gpu),
        Decides("stay", chunk_stays),
    ),
)


# -- running them ---------------------------------------------------------------------------


def choose_replica(
    replicas: Sequence[ReplicaT], now: float, ask: ReplicaAsk
) -> tuple[ReplicaT, Code]:
    """The replica ``REPLICA``'s first answering picker chooses among ``replicas`` (at least
    one), and why."""
    if len(replicas) == 1:
        return replicas[0], Code.LEAST_LOADED
    pressures = [replica.pressure(now) for replica in replicas]
    for _, picker in REPLICA:
        chosen = picker(pressures, ask)
        if chosen is not None:
            return replicas[chosen[0]], chosen[1]
    raise AssertionError("the last replica picker always answers")


def decide(
    knobs: PolicyKnobs,
    loads: Loads,
    slo: SloClass | None = None,
    *,
    prompt_tokens: int | None = None,
) -> Decision:
    """Route a new request of SLO class ``slo`` (None: a request judged without a class)
    with a prompt of about ``prompt_tokens`` (None: unknown; no CPU prefill is estimated),
    on the loads alone: nothing of the request or its deployment rules a route out."""
    return NEW_REQUEST.run(Ask(knobs, loads, slo, prompt_tokens))


def decide_next_chunk(knobs: PolicyKnobs, loads: Loads, slo: SloClass | None = None) -> Decision:
    """After a CPU chunk: keep decoding on the CPU (PD) or move the sequence to the GPU.
    ``loads.cpu`` must not count this sequence (its chunk just ended)."""
    return NEXT_CHUNK.run(Ask(knobs, loads, slo))
