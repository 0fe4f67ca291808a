"""The benchmark scenarios of MISSION.md, and concurrency ladders.

Pure data and pure functions with no I/O, so the control plane can import this module to
offer the same scenarios in its API, admin and schedules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    """A request shape: every request sends ``input_tokens`` and asks for ``output_tokens``."""

    name: str
    input_tokens: int
    output_tokens: int
    concurrency_min: int
    concurrency_max: int
    description: str = ""

    def __post_init__(self) -> None:
        if self.input_tokens < 1:
            raise ValueError(f"input_tokens must be at least 1, got {self.input_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be at least 1, got {self.output_tokens}")
        if not 1 <= self.concurrency_min <= self.concurrency_max:
            raise ValueError(
                f"concurrency range {self.concurrency_min}-{self.concurrency_max} is not valid"
            )

    @property
    def concurrency_levels(self) -> tuple[int, ...]:
        """The scenario's default rows: the doubling ladder over its concurrency range."""
        return doubling_ladder(self.concurrency_min, self.concurrency_max)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "concurrency_min": self.concurrency_min,
            "concurrency_max": self.concurrency_max,
            "description": self.description,
        }


# MISSION.md, "The benchmark of the documents".
SCENARIOS: dict[str, Scenario] = {
    "short": Scenario("short", 128, 256, 1, 16, "chat"),
    "medium": Scenario("medium", 512, 1024, 1, 8, "generation"),
    "long": Scenario("long", 2048, 512, 1, 4, "long context"),
    # The two regimes where CPU decode can pay (docs/benchmarks.md, "Goodput at SLO"): sized
    # so the GPU of either benchmark pair is saturated; ``hetero.sweep.derivation`` prints why.
    "decode-heavy": Scenario(
        "decode-heavy", 256, 4096, 16, 256, "long outputs: the GPU's KV cache fills first"
    ),
    "prefill-interference": Scenario(
        "prefill-interference", 1536, 768, 4, 64, "long prompts arrive while others decode"
    ),
}

MAX_CONCURRENCY = 4096

# OpenAI's ``service_tier`` of each SLO class (docs/tenants.md): what a client sends to ask
# the router for the class.
SERVICE_TIERS = {"interactive": "priority", "standard": "default", "batch": "flex"}


@dataclass(frozen=True)
class ClassShare:
    """One SLO class of a mixed workload: its request shape and its share of the requests."""

    slo_class: str
    scenario: Scenario
    share: float

    def __post_init__(self) -> None:
        if self.slo_class not in SERVICE_TIERS:
            known = ", ".join(SERVICE_TIERS)
            raise ValueError(f"unknown SLO class {self.slo_class!r} (known: {known})")
        if not 0 < self.share <= 1:
            raise ValueError(f"share of {self.slo_class} must be in (0, 1], got {self.share:g}")

    @property
    def service_tier(self) -> str:
        return SERVICE_TIERS[self.slo_class]


@dataclass(frozen=True)
class MixedScenario:
    """Requests of several SLO classes, each of its own shape (docs/benchmarks.md, "Mixed
    traffic"). The shares say how a closed or single-rate run draws each request's class;
    the mixed-traffic benchmark instead offers each class at a rate of its own."""

    name: str
    classes: tuple[ClassShare, ...]
    description: str = ""

    def __post_init__(self) -> None:
        names = [c.slo_class for c in self.classes]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"mixed scenario {self.name!r} needs distinct classes, got {names}")
        total = sum(c.share for c in self.classes)
        if abs(total - 1.0) > 1e-9:
            raise ValueError(
                f"the shares of mixed scenario {self.name!r} add up to {total:g}, not 1"
            )

    def for_class(self, slo_class: str) -> Scenario:
        for share in self.classes:
            if share.slo_class == slo_class:
                return share.scenario
        raise KeyError(slo_class)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "description": self.description,
            "classes": [
                {"slo_class": c.slo_class, "share": c.share, "scenario": c.scenario.to_dict()}
                for c in self.classes
            ],
        }


# People chatting (MISSION.md's short scenario, as interactive) beside generation work that
# can wait (its medium scenario, as batch: evaluations, summaries, synthetic data).
MIXED_SCENARIOS: dict[str, MixedScenario] = {
    "chat-and-batch": MixedScenario(
        "chat-and-batch",
        (
            ClassShare("interactive", SCENARIOS["short"], 0.5),
            ClassShare("batch", SCENARIOS["medium"], 0.5),
        ),
        "interactive chat (128 -> 256) beside batch generation (512 -> 1024)",
    ),
}


def custom_scenario(input_tokens: int, output_tokens: int) -> Scenario:
    """A scenario of the operator's own shape; it has no concurrency range of its own."""
    return Scenario("custom", input_tokens, output_tokens, 1, 1, "custom")


def resolve_scenario(
    name: str, input_tokens: int | None = None, output_tokens: int | None = None
) -> Scenario:
    """The named scenario, with its token counts overridden where given.

    ``custom`` requires both counts. Overriding a named scenario keeps its name and range so a
    row still says which of MISSION.md's scenarios it varies.
    """
    if name == "custom":
        if input_tokens is None or output_tokens is None:
            raise ValueError("the custom scenario needs both input and output token counts")
        return custom_scenario(input_tokens, output_tokens)
    try:
        base = SCENARIOS[name]
    except KeyError:
        known = ", ".join([*SCENARIOS, "custom"])
        raise ValueError(f"unknown scenario {name!r} (known: {known})") from None
    if input_tokens is None and output_tokens is None:
        return base
    return Scenario(
        base.name,
        input_tokens if input_tokens is not None else base.input_tokens,
        output_tokens if output_tokens is not None else base.output_tokens,
        base.concurrency_min,
        base.concurrency_max,
        base.description,
    )


def doubling_ladder(low: int, high: int) -> tuple[int, ...]:
    """``low``, doubling while below ``high``, then ``high``: 1-16 gives 1, 2, 4, 8, 16.

    MISSION.md's medium table reports concurrency 1, 2, 4 and 8 for the range 1-8, so a range
    means this ladder rather than every integer in it.
    """
    if not 1 <= low <= high:
        raise ValueError(f"concurrency range {low}-{high} is not valid")
    levels = []
    level = low
    while level < high:
        levels.append(level)
        level *= 2
    levels.append(high)
    return tuple(levels)


def parse_concurrency(text: str) -> tuple[int, ...]:
    """Parse ``8``, a list ``1,2,4,8`` or a range ``1-8`` (the doubling ladder) into levels.

    Items may be mixed (``1-4,16``); duplicates collapse and the order is ascending.
    """
    levels: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty item in concurrency {text!r}")
        try:
            if "-" in item:
                low_text, high_text = item.split("-", 1)
                levels.update(doubling_ladder(int(low_text), int(high_text)))
            else:
                levels.add(int(item))
        except ValueError as exc:
            raise ValueError(f"bad concurrency {item!r}: {exc}") from None
    for level in levels:
        if not 1 <= level <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency {level} is outside 1-{MAX_CONCURRENCY}")
    return tuple(sorted(levels))
