"""The live matrix's scenarios: a seeded generator over pairs, request shapes, SLOs and rates.

``scripts/bench/live_matrix.py`` runs them live and in virtual time side by side
(``hetero.live``); docs/benchmarks.md ("The live matrix") says why: the live results are the
decider's acceptance, and the virtual model is corrected until it predicts them.

The rules, all from one ``random.Random(seed)``:

- single-class scenario ``i`` runs on pair ``PAIR_ORDER[i % 2]`` with shape
  ``SHAPES[(i // 2) % 3]``, so any 6 consecutive scenarios cover both pairs and every shape;
  its prompt and output lengths are drawn from the shape's lists (``SHAPE_TOKENS``). A
  scenario is **decode-heavy** when its output is at least ``DECODE_HEAVY_RATIO`` times its
  prompt; the lists make every decode-heavy draw one and no other;
- its SLO is the pair's, each target scaled by a drawn factor (``TTFT_FACTORS``,
  ``TPOT_FACTORS``);
- its three rates are drawn multiples (``RATE_FACTORS``) of the GPU's knee: GPU-only's
  highest rate at ``KNEE_ATTAINMENT`` % SLO attainment **measured in the virtual model**
  (``gpu_knee``: the goodput search over ``default_rates``), at the scenario's own SLO; the
  last factor is above 1, so the last rate is past the knee; a decode-heavy scenario adds a
  fourth, hetero's own knee in the virtual model (``hetero_knee``), where its gain shows:
  the drawn rates are below both knees or past both, where the two modes tie or both fail;
- a run at a rate sends ``steady_requests`` requests: at least ``KNEE_REQUESTS``, and enough
  that arrivals last ``STEADY_LIFETIMES`` times a request's longest life within its SLO. A
  shorter run is mostly ramp: a decode-heavy run of 60 requests ends its arrivals before the
  first of them finishes, the GPU's batch never reaches the size the rate sustains, and
  every rate looks comfortable (the first matrix's decode-heavy knees were 2-3x too high);
- mixed scenario ``j`` runs ``MIXED_TRAFFIC`` on pair ``PAIR_ORDER[j % 2]`` at the pair's
  SLO (batch: ``BATCH_TPOT_FACTOR`` x its TPOT), the interactive rate held at what GPU-only
  alone serves at 99 % (``hetero.mixed.interactive_rate``), and three batch rates: drawn
  multiples (``BATCH_FACTORS``) of the CPU's batch capacity (``cpu_batch_capacity``).

Pure: no I/O. The knee and interactive-rate functions are parameters so a test can pin the
draws without running the virtual model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace

from hetero.mixed import INTERACTIVE_ATTAINMENT, cpu_batch_capacity, interactive_rate
from hetero.sweep import PAIRS, Pair, default_rates, measure, pair_knobs
from loadgen.goodput import GoodputSearch
from loadgen.scenarios import MIXED_SCENARIOS, MixedScenario, Scenario, custom_scenario
from sim.engine import plan_capacity

PAIR_ORDER = ("a10-xeon", "a100-kunpeng")
SHAPES = ("prompt-heavy", "balanced", "decode-heavy")
# (prompt lengths, output lengths or, for balanced, output/prompt ratios).
SHAPE_TOKENS: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {
    "prompt-heavy": ((1024, 1536, 2048, 3072), (64, 128, 256)),
    "balanced": ((256, 512, 1024), (0.5, 1.0, 1.5)),
    "decode-heavy": ((128, 256, 512), (1024, 2048, 4096)),
}
DECODE_HEAVY_RATIO = 2.0
TTFT_FACTORS = (0.75, 1.0, 1.5)
TPOT_FACTORS = (0.8, 1.0, 1.25)  # few values: a router restarts when its knobs change
# Comfortable, about at the knee, past it.
RATE_FACTORS = ((0.4, 0.5, 0.6), (0.8, 1.0), (1.5, 2.0))
KNEE_ATTAINMENT = 90.0
KNEE_REQUESTS = 60
STEADY_LIFETIMES = 3.0
KNEE_BISECTIONS = 3
# The interactive rate is found at as many requests as a mixed cell sends (hetero.live's
# MIXED_REQUESTS): with fewer, a burst the GPU absorbs passes for a rate it sustains.
INTERACTIVE_REQUESTS = 600
MIXED_TRAFFIC = "chat-and-batch"
BATCH_FACTORS = ((0.2, 0.25), (0.5,), (1.0, 1.5))
DEFAULT_COUNT = 12
DEFAULT_MIXED = 2

Knee = Callable[[Pair, Scenario], float]
InteractiveRate = Callable[[Pair, MixedScenario], float]


@dataclass(frozen=True)
class MatrixScenario:
    """One scenario of the matrix: a pair, a shape, an SLO and three rates.

    A mixed scenario (``traffic`` set) sends its traffic's classes at their own shapes:
    ``interactive_rate`` of interactive requests, and ``rates`` are its batch rates; the
    SLO is the interactive class's.
    """

    id: str
    pair: str
    shape: str  # prompt-heavy, balanced, decode-heavy or mixed
    input_tokens: int
    output_tokens: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    rates: tuple[float, ...]  # increasing; three, or four for a decode-heavy scenario
    knee: float  # the GPU's knee (single-class) or the CPU's batch capacity (mixed), req/s
    traffic: str | None = None
    interactive_rate: float | None = None
    hetero_knee: float | None = None  # decode-heavy: hetero's knee in the virtual model, req/s

    @property
    def mixed(self) -> bool:
        return self.traffic is not None

    @property
    def decode_heavy(self) -> bool:
        return not self.mixed and is_decode_heavy(self.input_tokens, self.output_tokens)

    @property
    def scenario(self) -> Scenario:
        return custom_scenario(self.input_tokens, self.output_tokens)

    def requests_at(self, rate: float, at_least: int) -> int:
        """A single-class run's requests at ``rate``: ``steady_requests``, ``at_least``."""
        steady = steady_requests(rate, self.output_tokens, self.slo_ttft_ms, self.slo_tpot_ms)
        return max(at_least, steady)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "decode_heavy": self.decode_heavy}


def is_decode_heavy(input_tokens: int, output_tokens: int) -> bool:
    return output_tokens >= DECODE_HEAVY_RATIO * input_tokens


def scenario_pair(scenario: MatrixScenario) -> Pair:
    """The scenario's pair with its SLO."""
    return replace(
        PAIRS[scenario.pair], slo_ttft_ms=scenario.slo_ttft_ms, slo_tpot_ms=scenario.slo_tpot_ms
    )


def steady_requests(rate: float, output_tokens: int, slo_ttft_ms: float, slo_tpot_ms: float) -> int:
    """Requests for a run at ``rate`` to reach its steady state: arrivals that last
    ``STEADY_LIFETIMES`` times the longest life of a request within its SLO (its TTFT target
    plus every later token at the TPOT target), at least ``KNEE_REQUESTS``. By Little's law
    that is ``STEADY_LIFETIMES`` times the concurrency the rate sustains."""
    life_s = (slo_ttft_ms + max(output_tokens - 1, 0) * slo_tpot_ms) / 1000.0
    return max(KNEE_REQUESTS, math.ceil(STEADY_LIFETIMES * rate * life_s))


def mode_knee(pair: Pair, scenario: Scenario, mode: str) -> float:
    """``mode``'s highest rate at ``KNEE_ATTAINMENT`` % in the virtual model (req/s), each rate
    run to its steady state; where it meets no rate swept, the lowest rate swept."""
    rates = default_rates(pair, scenario)
    search = GoodputSearch(rates, target=KNEE_ATTAINMENT, bisections=KNEE_BISECTIONS)
    knobs = pair_knobs(pair, mode)
    while (rate := search.next_rate()) is not None:
        requests = steady_requests(rate, scenario.output_tokens, pair.slo_ttft_ms, pair.slo_tpot_ms)
        point, _ = measure(pair, scenario, mode, rate, requests=requests, knobs=knobs)
        search.record(replace(point, bisection=rate not in rates))
    return search.max_goodput_rate or rates[0]


def gpu_knee(pair: Pair, scenario: Scenario) -> float:
    """GPU-only's knee (``mode_knee``)."""
    return mode_knee(pair, scenario, "gpu")


def hetero_knee(pair: Pair, scenario: Scenario) -> float:
    """Hetero's knee (``mode_knee``) under the matrix's hetero policy."""
    return mode_knee(pair, scenario, "hetero")


def gpu_interactive_rate(pair: Pair, traffic: MixedScenario) -> float:
    """GPU-only's interactive rate at 99 % in the virtual model (req/s)."""
    search = interactive_rate(
        pair, traffic, requests=INTERACTIVE_REQUESTS, bisections=KNEE_BISECTIONS,
        target=INTERACTIVE_ATTAINMENT,
    )  # fmt: skip
    return search.max_goodput_rate or search.rates[0]


def two_figures(value: float, *, down: bool = False) -> float:
    """``value`` to two significant figures (rounded down with ``down``)."""
    digits = 1 - math.floor(math.log10(value))
    scale = 10.0**digits
    if down:
        return math.floor(value * scale) / scale
    return float(round(value, digits))


def rate_triple(base: float, factors: tuple[float, float, float]) -> tuple[float, float, float]:
    """``base`` times each factor to two significant figures, kept strictly increasing."""
    out: list[float] = []
    for factor in factors:
        value = two_figures(base * factor)
        if out and value <= out[-1]:
            value = two_figures(out[-1] * 1.1)
        out.append(value)
    return (out[0], out[1], out[2])


def _draw(rng: random.Random, choices: tuple[tuple[float, ...], ...]) -> tuple[float, float, float]:
    a, b, c = (rng.choice(group) for group in choices)
    return (a, b, c)


def context_limit(pair: Pair) -> int:
    return min(plan_capacity(pair.gpu).max_model_len, plan_capacity(pair.cpu).max_model_len)


def generate(
    seed: int = 0,
    count: int = DEFAULT_COUNT,
    mixed: int = DEFAULT_MIXED,
    *,
    knee: Knee = gpu_knee,
    knee_hetero: Knee = hetero_knee,
    interactive: InteractiveRate = gpu_interactive_rate,
    only: Collection[str] | None = None,
) -> tuple[MatrixScenario, ...]:
    """``count`` single-class scenarios then ``mixed`` mixed ones; the same arguments give
    the same matrix. ``only`` keeps those ids (the others are drawn, not measured)."""
    rng = random.Random(seed)
    out: list[MatrixScenario] = []
    for i in range(count):
        pair = PAIRS[PAIR_ORDER[i % len(PAIR_ORDER)]]
        shape = SHAPES[(i // len(PAIR_ORDER)) % len(SHAPES)]
        prompts, outputs = SHAPE_TOKENS[shape]
        prompt = rng.choice(prompts)
        drawn = rng.choice(outputs)
        output = int(prompt * drawn) if shape == "balanced" else int(drawn)
        if prompt + output > context_limit(pair):
            raise ValueError(f"{shape} draw {prompt}+{output} exceeds {pair.name}'s context")
        slo_pair = replace(
            pair,
            slo_ttft_ms=pair.slo_ttft_ms * rng.choice(TTFT_FACTORS),
            slo_tpot_ms=pair.slo_tpot_ms * rng.choice(TPOT_FACTORS),
        )
        factors = _draw(rng, RATE_FACTORS)
        sid = f"s{seed}-{i:02d}-{pair.name}-{shape}"
        if only is not None and sid not in only:
            continue
        gpu = knee(slo_pair, custom_scenario(prompt, output))
        rates: tuple[float, ...] = rate_triple(gpu, factors)
        gain_rate = None
        if is_decode_heavy(prompt, output):
            gain_rate = two_figures(knee_hetero(slo_pair, custom_scenario(prompt, output)))
            rates = tuple(sorted({*rates, gain_rate}))
        out.append(
            MatrixScenario(
                id=sid,
                pair=pair.name,
                shape=shape,
                input_tokens=prompt,
                output_tokens=output,
                slo_ttft_ms=slo_pair.slo_ttft_ms,
                slo_tpot_ms=slo_pair.slo_tpot_ms,
                rates=rates,
                knee=gpu,
                hetero_knee=gain_rate,
            )
        )
    traffic = MIXED_SCENARIOS[MIXED_TRAFFIC]
    for j in range(mixed):
        pair = PAIRS[PAIR_ORDER[j % len(PAIR_ORDER)]]
        factors = _draw(rng, BATCH_FACTORS)
        sid = f"s{seed}-m{j}-{pair.name}-mixed"
        if only is not None and sid not in only:
            continue
        capacity = cpu_batch_capacity(pair, traffic)
        batch = traffic.for_class("batch")
        out.append(
            MatrixScenario(
                id=sid,
                pair=pair.name,
                shape="mixed",
                input_tokens=batch.input_tokens,
                output_tokens=batch.output_tokens,
                slo_ttft_ms=pair.slo_ttft_ms,
                slo_tpot_ms=pair.slo_tpot_ms,
                rates=rate_triple(capacity, factors),
                knee=capacity,
                traffic=traffic.name,
                interactive_rate=two_figures(interactive(pair, traffic), down=True),
            )
        )
    return tuple(out)
