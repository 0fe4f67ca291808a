"""The PD scheduling policy's knobs: one definition shared by the control plane and the router.

Pure Python with no Django import, so the router can validate a policy it pulled (or read
from a file) with exactly the rules the control plane used when it was saved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from common.decisions import Mode, ReplicaChoice
from common.errors import FieldError

# The policy's modes, as the enumeration lists them (common/decisions.py).
MODES = tuple(mode.value for mode in Mode)
ALGORITHMS = ("capacity", "syshax-threshold")
REPLICA_CHOICES = tuple(choice.value for choice in ReplicaChoice)


class PolicyError(FieldError):
    """A policy value is out of range. ``field`` names the knob."""


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    meaning: str = ""


# The SLO classes a request may ask for (docs/tenants.md). Each is a group of policy knobs
# named ``<class>_<field>``, so a class's targets are versioned, diffed and rolled back with
# the rest of the policy. The set is fixed: OpenAI's ``service_tier`` names three (priority,
# default, flex) and these are their classes (docs/decisions/0049-slo-classes-as-knobs.md).
SLO_CLASSES = ("interactive", "standard", "batch")


@dataclass(frozen=True)
class SloClass:
    """A request class: its latency targets, its priority (lower is served first, as vLLM's
    ``priority`` field), whether the router may shed it when its queues fill, and whether
    its decode goes to the CPU first whenever the CPU meets its TPOT target."""

    name: str
    ttft_ms: float
    tpot_ms: float
    priority: int
    sheddable: bool
    cpu_first: bool


DEFAULT_SLO_CLASSES = (
    SloClass(
        "interactive", ttft_ms=1000.0, tpot_ms=50.0, priority=0, sheddable=False, cpu_first=False
    ),
    SloClass(
        "standard", ttft_ms=3000.0, tpot_ms=100.0, priority=1, sheddable=False, cpu_first=False
    ),
    SloClass("batch", ttft_ms=60000.0, tpot_ms=300.0, priority=2, sheddable=True, cpu_first=True),
)


def class_knobs(slo: SloClass) -> tuple[Knob, ...]:
    c = slo.name
    # The standard class's TPOT target is ``cpu_decode_slo_ms``: a request without a class
    # of its own is judged as before classes existed, by one knob.
    tpot = (
        ()
        if c == "standard"
        else (
            Knob(
                f"{c}_tpot_ms",
                float,
                slo.tpot_ms,
                1.0,
                60000.0,
                meaning=f"SLO class {c}: time-per-output-token target (ms); with class_aware "
                "the CPU takes this class's decode only while its token latency meets it",
            ),
        )
    )
    return (
        Knob(
            f"{c}_ttft_ms",
            float,
            slo.ttft_ms,
            1.0,
            3600000.0,
            meaning=f"SLO class {c}: time-to-first-token target (ms)",
        ),
        *tpot,
        Knob(
            f"{c}_priority",
            int,
            slo.priority,
            0,
            1000,
            meaning=f"SLO class {c}: priority (lower first) in the router's queues and "
            "vLLM's priority scheduling",
        ),
        Knob(
            f"{c}_sheddable",
            bool,
            slo.sheddable,
            meaning=f"SLO class {c}: the router may turn these requests away (429) first "
            "when its queues fill",
        ),
        Knob(
            f"{c}_cpu_first",
            bool,
            slo.cpu_first,
            meaning=f"SLO class {c}: with class_aware, decode on the CPU whenever it meets "
            "this class's TPOT target, keeping the GPU for the other classes",
        ),
    )


# Defaults follow sysHAX's example configuration where it has one (MISSION.md).
KNOBS: tuple[Knob, ...] = (
    Knob(
        "mode",
        str,
        "auto",
        choices=MODES,
        meaning="auto decides per request; gpu-only, cpu-only and forced-pd pin every request",
    ),
    Knob(
        "algorithm",
        str,
        "capacity",
        choices=ALGORITHMS,
        meaning="decider used in auto mode: capacity-aware, or sysHAX's threshold decider",
    ),
    Knob(
        "enable_auto_pd_offload",
        bool,
        True,
        meaning="sysHAX enable_auto_pd_offload: prefill on GPU/NPU, decode may move to the CPU",
    ),
    Knob(
        "max_num_seqs",
        int,
        256,
        1,
        65536,
        meaning="GPU running sequences at which new decode work is offloaded to the CPU",
    ),
    Knob(
        "gpu_cache_threshold",
        float,
        90.0,
        0.0,
        100.0,
        meaning="GPU KV-cache usage (%) above which decode is offloaded to the CPU",
    ),
    Knob(
        "cpu_throughput_threshold",
        float,
        10.0,
        0.0,
        100000.0,
        meaning="CPU decode throughput (tokens/s) below which the CPU takes no more work",
    ),
    Knob(
        "token_limit_multiplier",
        float,
        4.0,
        0.0,
        1000.0,
        meaning="CPU decode chunk = multiplier x CPU throughput, clamped to [min, max]",
    ),
    Knob(
        "token_limit_min",
        int,
        10,
        1,
        100000,
        meaning="fewest tokens the CPU decodes before the scheduler decides again",
    ),
    Knob(
        "token_limit_max",
        int,
        100,
        1,
        100000,
        meaning="most tokens the CPU decodes before the scheduler decides again",
    ),
    Knob(
        "cpu_max_batch_size",
        int,
        8,
        0,
        4096,
        meaning="most sequences decoding on the CPU at once (sysHAX cpu_max_batch_size)",
    ),
    Knob(
        "cpu_decode_slo_ms",
        float,
        100.0,
        1.0,
        60000.0,
        meaning="capacity decider: the CPU takes decode only while its token latency stays below",
    ),
    Knob(
        "gpu_decode_slo_ms",
        float,
        50.0,
        1.0,
        60000.0,
        meaning="capacity decider: GPU token latency treated as the batch's latency knee",
    ),
    Knob(
        "gpu_max_temperature_c",
        float,
        90.0,
        0.0,
        150.0,
        meaning="capacity decider: a GPU/NPU at or past this temperature (the agents' "
        "heartbeats) is treated as saturated and new decodes go to the CPU",
    ),
    Knob(
        "cpu_max_memory_percent",
        float,
        95.0,
        0.0,
        100.0,
        meaning="capacity decider: host RAM use (%) at or past which the CPU engine takes no "
        "new decode (its KV cache lives in host RAM)",
    ),
    Knob(
        "max_queue_size",
        int,
        200,
        0,
        1000000,
        meaning="requests waiting in the router before it answers 429",
    ),
    Knob(
        "request_timeout_seconds",
        float,
        600.0,
        1.0,
        86400.0,
        meaning="longest a request may take end to end",
    ),
    Knob(
        "metrics_interval_seconds",
        float,
        1.0,
        0.1,
        60.0,
        meaning="how often the router scrapes each engine's /metrics (sysHAX: 5 s)",
    ),
    Knob(
        "class_aware",
        bool,
        True,
        meaning="capacity decider: judge the CPU against each request's SLO class (its TPOT "
        "target, and whether the class decodes on the CPU first); off: every request is judged "
        "against cpu_decode_slo_ms alike",
    ),
    Knob(
        "replica_choice",
        str,
        "prefix",
        choices=REPLICA_CHOICES,
        meaning="how a model's replica is picked: least-loaded, or prefix (the replica sent the "
        "longest start of the prompt, among those within prefix_load_slack of the least loaded)",
    ),
    Knob(
        "prefix_load_slack",
        float,
        4.0,
        0.0,
        1000000.0,
        meaning="prefix replica choice: how many more requests in flight than the least loaded "
        "replica a replica holding the prompt's prefix may have and still be chosen",
    ),
    Knob(
        "prefix_min_tokens",
        int,
        256,
        0,
        10000000,
        meaning="prefix replica choice: the fewest prompt tokens a replica must hold for the "
        "prefix to count (below: least-loaded)",
    ),
    *(knob for slo in DEFAULT_SLO_CLASSES for knob in class_knobs(slo)),
)
KNOBS_BY_NAME = {knob.name: knob for knob in KNOBS}


@dataclass(frozen=True)
class PolicyKnobs:
    mode: str = "auto"
    algorithm: str = "capacity"
    enable_auto_pd_offload: bool = True
    max_num_seqs: int = 256
    gpu_cache_threshold: float = 90.0
    cpu_throughput_threshold: float = 10.0
    token_limit_multiplier: float = 4.0
    token_limit_min: int = 10
    token_limit_max: int = 100
    cpu_max_batch_size: int = 8
    cpu_decode_slo_ms: float = 100.0
    gpu_decode_slo_ms: float = 50.0
    gpu_max_temperature_c: float = 90.0
    cpu_max_memory_percent: float = 95.0
    max_queue_size: int = 200
    request_timeout_seconds: float = 600.0
    metrics_interval_seconds: float = 1.0
    class_aware: bool = True
    replica_choice: str = "prefix"
    prefix_load_slack: float = 4.0
    prefix_min_tokens: int = 256
    interactive_ttft_ms: float = 1000.0
    interactive_tpot_ms: float = 50.0
    interactive_priority: int = 0
    interactive_sheddable: bool = False
    interactive_cpu_first: bool = False
    standard_ttft_ms: float = 3000.0
    standard_priority: int = 1
    standard_sheddable: bool = False
    standard_cpu_first: bool = False
    batch_ttft_ms: float = 60000.0
    batch_tpot_ms: float = 300.0
    batch_priority: int = 2
    batch_sheddable: bool = True
    batch_cpu_first: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def slo_class(self, name: str) -> SloClass:
        """The SLO class ``name`` (one of ``SLO_CLASSES``) with this policy's targets."""
        if name not in SLO_CLASSES:
            raise KeyError(name)
        return SloClass(
            name,
            ttft_ms=getattr(self, f"{name}_ttft_ms"),
            tpot_ms=self.cpu_decode_slo_ms
            if name == "standard"
            else getattr(self, f"{name}_tpot_ms"),
            priority=getattr(self, f"{name}_priority"),
            sheddable=getattr(self, f"{name}_sheddable"),
            cpu_first=getattr(self, f"{name}_cpu_first"),
        )

    def slo_classes(self) -> dict[str, SloClass]:
        return {name: self.slo_class(name) for name in SLO_CLASSES}


def coerce_value(name: str, raw: Any) -> Any:
    """Convert ``raw`` (possibly a CLI string) to the knob's type and check its range."""
    knob = KNOBS_BY_NAME.get(name)
    if knob is None:
        raise PolicyError(name, f"unknown knob; known knobs are {', '.join(KNOBS_BY_NAME)}")
    value: Any
    if knob.kind is bool:
        if isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.strip().lower() in {"true", "1", "yes", "on"}:
            value = True
        elif isinstance(raw, str) and raw.strip().lower() in {"false", "0", "no", "off"}:
            value = False
        else:
            raise PolicyError(name, f"must be true or false, got {raw!r}")
    elif knob.kind is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise PolicyError(name, f"must be an integer, got {raw!r}")
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise PolicyError(name, f"must be an integer, got {raw!r}") from None
    elif knob.kind is float:
        if isinstance(raw, bool):
            raise PolicyError(name, f"must be a number, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise PolicyError(name, f"must be a number, got {raw!r}") from None
        if value != value:  # NaN
            raise PolicyError(name, "must be a number, got NaN")
    else:
        if not isinstance(raw, str):
            raise PolicyError(name, f"must be a string, got {raw!r}")
        value = raw.strip()
    if knob.choices is not None and value not in knob.choices:
        raise PolicyError(name, f"must be one of {', '.join(knob.choices)}; got {value!r}")
    if knob.minimum is not None and value < knob.minimum:
        raise PolicyError(name, f"must be at least {knob.minimum:g}; got {value}")
    if knob.maximum is not None and value > knob.maximum:
        raise PolicyError(name, f"must be at most {knob.maximum:g}; got {value}")
    return value


def validate_knobs(data: dict[str, Any], *, partial: bool = False) -> PolicyKnobs:
    """Build a ``PolicyKnobs`` from a mapping, raising ``PolicyError`` on the first bad knob.

    Unknown keys are errors (a typo must not silently keep the old value). With ``partial``
    missing knobs take their defaults; otherwise every knob must be present.
    """
    knobs, errors = _checked(data, partial=partial)
    if errors or knobs is None:
        raise errors[0]
    return knobs


def knob_errors(data: dict[str, Any], *, partial: bool = False) -> list[PolicyError]:
    """Every reason ``validate_knobs`` refuses ``data``, at once (empty when it accepts it):
    each bad or missing knob in turn, then the rules across knobs, which are checked once
    every knob is valid on its own. A form shows them all in one round."""
    return _checked(data, partial=partial)[1]


def _checked(
    data: dict[str, Any], *, partial: bool
) -> tuple[PolicyKnobs | None, list[PolicyError]]:
    """The knobs, or every error in the order ``validate_knobs`` meets them."""
    if not isinstance(data, dict):
        return None, [PolicyError("policy", "must be a JSON object")]
    values: dict[str, Any] = {}
    errors: list[PolicyError] = []
    for key, raw in data.items():
        try:
            values[key] = coerce_value(key, raw)
        except PolicyError as exc:
            errors.append(exc)
    if not partial:
        names = [f.name for f in fields(PolicyKnobs)]
        errors.extend(PolicyError(name, "is required") for name in names if name not in data)
    if errors:
        return None, errors
    knobs = PolicyKnobs(**values)
    try:
        check_cross_field(knobs)
    except PolicyError as exc:
        return None, [exc]
    return knobs, []


def check_cross_field(knobs: PolicyKnobs) -> None:
    if knobs.token_limit_min > knobs.token_limit_max:
        raise PolicyError(
            "token_limit_min",
            f"must not exceed token_limit_max ({knobs.token_limit_min} > {knobs.token_limit_max})",
        )
