"""The deciders: pure functions from (policy knobs, device loads, what the request rules
out) to a routing decision, run as one ordered pipeline of named steps.

- ``pipeline``: the steps in order (the replica choice, a new request, a chunk boundary),
  and ``decide`` / ``decide_next_chunk`` that run them;
- ``steps``: each step, returning its verdict and reason code;
- ``deciders``: the algorithms some steps run (capacity, sysHAX's threshold, a CPU-first
  class, a forced mode held to the hard limits);
- ``signals``: what the steps read off the loads (GPU saturation, CPU room, projections).

The modes, routes and reason codes are ``common.decisions``'s enumerations.
"""

from common.decisions import Code, Mode, Route, Stage
from router.decide.deciders import hold_to_limits
from router.decide.pipeline import (
    NEW_REQUEST,
    NEXT_CHUNK,
    REPLICA,
    Decides,
    Overrides,
    Pipeline,
    ReplicaAsk,
    choose_replica,
    decide,
    decide_next_chunk,
)
from router.decide.signals import (
    CPU_FIRST_MIN_GAIN,
    CPU_PROBE_BATCH,
    CPU_SLO_MARGIN,
    CPU_TTFT_MARGIN,
    GPU_SPARE_MARGIN,
    Decision,
    Loads,
    cpu_allowed,
    cpu_seat_gain,
    cpu_slo_batch,
    cpu_ttft_ms,
    projected_itl_ms,
    retry_after_seconds,
    token_limit,
)
from router.decide.steps import Ask

__all__ = [
    "CPU_FIRST_MIN_GAIN",
    "CPU_PROBE_BATCH",
    "CPU_SLO_MARGIN",
    "CPU_TTFT_MARGIN",
    "GPU_SPARE_MARGIN",
    "NEW_REQUEST",
    "NEXT_CHUNK",
    "REPLICA",
    "Ask",
    "Code",
    "Decides",
    "Decision",
    "Loads",
    "Mode",
    "Overrides",
    "Pipeline",
    "ReplicaAsk",
    "Route",
    "Stage",
    "choose_replica",
    "cpu_allowed",
    "cpu_seat_gain",
    "cpu_slo_batch",
    "cpu_ttft_ms",
    "decide",
    "decide_next_chunk",
    "hold_to_limits",
    "projected_itl_ms",
    "retry_after_seconds",
    "token_limit",
]
