"""The pipeline's steps, each one rule that can change a route (``router.decide.pipeline``
lists them in order).

A *decider* answers with a :class:`Decision` or passes (None) to the next; the first answer
is the verdict. An *override* sees the verdict so far and may replace it (None: it stands).
Each answer carries its route and its reason code (``common.decisions.Code``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.decisions import Code, Mode, Route
from common.policy_schema import PolicyKnobs, SloClass
from router.decide.deciders import capacity, cpu_first_route, hold_to_limits, syshax_threshold
from router.decide.signals import (
    Decision,
    Loads,
    cpu_allowed,
    cpu_first,
    cpu_keeps,
    gpu_saturation,
    gpu_spare,
    token_limit,
)


# Not frozen: one is built for every decision, and a frozen dataclass's fields cost a
# ``object.__setattr__`` each. Nothing changes one after it is built.
@dataclass(slots=True)
class Ask:
    """All one decision is about: the policy, the engines' loads, the request's class and
    prompt, and what the request and its deployment rule out. The defaults rule out nothing
    (a decision on loads alone, as the virtual-time model asks for)."""

    knobs: PolicyKnobs
    loads: Loads
    slo: SloClass | None = None
    # About how many tokens the prompt has (None: unknown; no CPU prefill is estimated).
    prompt_tokens: int | None = None
    # The request's ``n``: how many choices it asks for.
    choices: int = 1
    # Whether the deployment has a CPU engine at all.
    has_cpu: bool = True
    # Why the deployment's PD protocol cannot splice this request's body (None: it can);
    # asked only of a PD verdict.
    unspliceable: Callable[[], str | None] | None = None
    # Whether the request pinned its mode (X-Syshax-Mode other than ``auto``).
    forced: bool = False

    @property
    def chunk(self) -> int:
        """The CPU's decode chunk for a PD route (``token_limit``)."""
        return token_limit(self.knobs, self.loads.cpu.throughput_tps)


Decider = Callable[[Ask], Decision | None]
Override = Callable[[Ask, Decision], Decision | None]


# -- a new request: the deciders ------------------------------------------------------------


def mode_cpu_only(ask: Ask) -> Decision | None:
    """Mode ``cpu-only`` pins the CPU; a 503 while it is down."""
    if ask.knobs.mode != Mode.CPU_ONLY:
        return None
    if ask.loads.cpu.available:
        return Decision(Route.CPU_ONLY, reason="mode cpu-only", code=Code.MODE)
    return Decision(
        Route.REJECTED,
        reason="mode cpu-only and the CPU engine is down",
        status=503,
        code=Code.CPU_DOWN,
    )


def gpu_down(ask: Ask) -> Decision | None:
    """The GPU engine is down: the CPU serves whole where the policy allows it, else 503."""
    if ask.loads.gpu.available:
        return None
    if cpu_allowed(ask.knobs) and ask.loads.cpu.available:
        return Decision(Route.CPU_ONLY, reason="GPU engine down", fallback=True, code=Code.GPU_DOWN)
    return Decision(Route.REJECTED, reason="GPU engine down", status=503, code=Code.GPU_DOWN)


def offload_off(ask: Ask) -> Decision | None:
    """The policy keeps the CPU out (``gpu-only``, ``auto`` without offload, no CPU batch)."""
    if cpu_allowed(ask.knobs):
        return None
    mode = ask.knobs.mode
    return Decision(Route.GPU_ONLY, reason=f"mode {mode}, CPU offload off", code=Code.OFFLOAD_OFF)


def mode_forced_pd(ask: Ask) -> Decision | None:
    """Mode ``forced-pd`` pins PD, the CPU decoding to the end; gpu-only while it is down."""
    if ask.knobs.mode != Mode.FORCED_PD:
        return None
    if ask.loads.cpu.available:
        return Decision(Route.PD, token_limit=0, reason="mode forced-pd", code=Code.MODE)
    return Decision(
        Route.GPU_ONLY, reason="forced-pd but CPU engine down", fallback=True, code=Code.CPU_DOWN
    )


def syshax_threshold_step(ask: Ask) -> Decision | None:
    """The ``syshax-threshold`` algorithm decides every request it is chosen for."""
    if ask.knobs.algorithm != "syshax-threshold":
        return None
    return syshax_threshold(ask.knobs, ask.loads)


def class_cpu_first(ask: Ask) -> Decision | None:
    """A ``cpu_first`` class (with ``class_aware``) is routed for the CPU first; passes where
    it is to be judged as any request."""
    if not cpu_first(ask.knobs, ask.slo):
        return None
    assert ask.slo is not None
    return cpu_first_route(ask.knobs, ask.loads, ask.chunk, ask.slo, ask.prompt_tokens)


def capacity_step(ask: Ask) -> Decision:
    """The capacity-aware algorithm: always answers, so the verdict is never missing."""
    return capacity(ask.knobs, ask.loads, ask.chunk, ask.slo, ask.prompt_tokens)


# -- a new request: the overrides -----------------------------------------------------------


def _to_gpu(verdict: Decision, why: str, code: Code) -> Decision | None:
    """A PD verdict turned gpu-only (the others stand)."""
    if verdict.route is not Route.PD:
        return None
    return Decision(Route.GPU_ONLY, reason=why, code=code)


def n_above_1(ask: Ask, verdict: Decision) -> Decision | None:
    """Splicing several choices across engines is not worth it; the GPU serves n > 1."""
    return _to_gpu(verdict, "n > 1", Code.N_ABOVE_1) if ask.choices > 1 else None


def no_cpu(ask: Ask, verdict: Decision) -> Decision | None:
    """A deployment without a CPU engine has nowhere to decode a PD route."""
    return None if ask.has_cpu else _to_gpu(verdict, "deployment has no CPU engine", Code.NO_CPU)


def not_spliceable(ask: Ask, verdict: Decision) -> Decision | None:
    """A body the deployment's PD protocol cannot splice goes to the GPU whole."""
    if verdict.route is not Route.PD or ask.unspliceable is None:
        return None
    why = ask.unspliceable()
    return None if why is None else _to_gpu(verdict, why, Code.NOT_SPLICEABLE)


def forced_limits(ask: Ask, verdict: Decision) -> Decision | None:
    """A forced mode picks the device, never past the policy's hard limits (a 429)."""
    if not ask.forced:
        return None
    held = hold_to_limits(verdict, ask.knobs, ask.loads)
    return None if held is verdict else held


# -- after a CPU chunk (``loads.cpu`` without this sequence) --------------------------------
#
# A move back costs the GPU a prefill of the whole context (no KV goes back), which delays
# every other sequence on a busy GPU and measured worse than staying (docs/benchmarks.md,
# "Goodput at SLO"): a sequence the CPU still serves within its target moves back only to an
# idle GPU; one it no longer serves within it, whenever the GPU can take it.


def chunk_cpu_down(ask: Ask) -> Decision | None:
    """The CPU engine went down: the rest goes to the GPU."""
    if ask.loads.cpu.available:
        return None
    return Decision(Route.GPU_ONLY, reason="CPU engine down", fallback=True, code=Code.CPU_DOWN)


def chunk_pinned(ask: Ask) -> Decision | None:
    """A pinned mode, sysHAX's algorithm (it sends continuations straight back to the CPU)
    or a GPU that is down keep the sequence on the CPU."""
    knobs = ask.knobs
    pinned = knobs.mode in (Mode.CPU_ONLY, Mode.FORCED_PD) or knobs.algorithm == "syshax-threshold"
    if not pinned and ask.loads.gpu.available:
        return None
    return Decision(Route.PD, token_limit=ask.chunk, reason="continue on CPU", code=Code.STAY)


def chunk_offload_off(ask: Ask) -> Decision | None:
    """The live policy now keeps the CPU out: the rest goes to the GPU."""
    if cpu_allowed(ask.knobs):
        return None
    why = f"policy now {ask.knobs.mode}, CPU offload off"
    return Decision(Route.GPU_ONLY, reason=why, code=Code.OFFLOAD_OFF)


def cpu_misses(ask: Ask) -> Decision | None:
    """The CPU no longer serves the sequence within its target (``cpu_keeps``): back to a GPU
    below every limit (for a ``cpu_first`` class, with clear spare room), else it stays."""
    keeps, keep_why = cpu_keeps(ask.knobs, ask.loads, ask.slo)
    if keeps:
        return None
    if cpu_first(ask.knobs, ask.slo):
        takes, gpu_why = gpu_spare(ask.knobs, ask.loads)
    else:
        saturated, gpu_why = gpu_saturation(ask.knobs, ask.loads)
        takes = not saturated
    if takes:
        code = Code.CPU_STALE if ask.loads.cpu.stale else Code.BACK_CPU_SLOW
        return Decision(Route.GPU_ONLY, reason=f"{keep_why}; {gpu_why}", code=code)
    reason = f"stay on CPU: {keep_why}; {gpu_why}"
    return Decision(Route.PD, token_limit=ask.chunk, reason=reason, code=Code.STAY)


def class_stays(ask: Ask) -> Decision | None:
    """A ``cpu_first`` class the CPU still serves stays there, however idle the GPU."""
    if not cpu_first(ask.knobs, ask.slo):
        return None
    assert ask.slo is not None
    reason = f"class {ask.slo.name} stays on the CPU"
    return Decision(Route.PD, token_limit=ask.chunk, reason=reason, code=Code.STAY)


def idle_gpu(ask: Ask) -> Decision | None:
    """An idle GPU delays nobody by recomputing this context, and decodes it faster."""
    gpu = ask.loads.gpu
    if gpu.running or gpu.waiting or gpu_saturation(ask.knobs, ask.loads)[0]:
        return None
    return Decision(Route.GPU_ONLY, reason="back to the idle GPU", code=Code.BACK)


def chunk_stays(ask: Ask) -> Decision:
    """Otherwise the sequence stays on the CPU for another chunk."""
    return Decision(Route.PD, token_limit=ask.chunk, reason="stay on CPU", code=Code.STAY)
