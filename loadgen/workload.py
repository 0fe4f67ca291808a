"""The requests of a run and when to send them. Pure functions of a seed, no I/O.

A prompt of N whitespace-separated words is N prompt tokens on the simulator (one token per
word). On a real tokenizer the count differs; the server's usage chunk then reports the real
number and the statistics use it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from loadgen.scenarios import MixedScenario

# Ordinary short words: most real tokenizers also map each to a single token.
_VOCABULARY = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "from",
    "have",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt and exact lengths, and (in a mixed workload) the
    OpenAI ``service_tier`` that asks the router for its SLO class."""

    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int
    service_tier: str | None = None


def make_prompt(words: int, rng: random.Random) -> str:
    """A prompt of exactly ``words`` words drawn from a fixed vocabulary."""
    if words < 1:
        raise ValueError(f"a prompt needs at least one word, got {words}")
    return " ".join(rng.choice(_VOCABULARY) for _ in range(words))


# Warm-up requests get indexes from here on, so they never collide with measured ones.
WARMUP_INDEX = 1_000_000


def build_requests(
    count: int, input_tokens: int, output_tokens: int, seed: int, first_index: int = 0
) -> list[RequestSpec]:
    """``count`` requests with distinct prompts; the same seed gives the same prompts.

    Distinct prompts keep a prefix cache from turning the benchmark into a cache benchmark.
    """
    rng = random.Random(seed)
    return [
        RequestSpec(
            first_index + offset, make_prompt(input_tokens, rng), input_tokens, output_tokens
        )
        for offset in range(count)
    ]


def build_mixed_requests(
    count: int, mix: MixedScenario, seed: int, first_index: int = 0
) -> list[RequestSpec]:
    """``count`` requests whose classes are drawn by ``mix``'s shares, each of its class's
    shape and carrying its class's ``service_tier``; the same seed gives the same requests."""
    rng = random.Random(seed)
    weights = [c.share for c in mix.classes]
    specs = []
    for offset in range(count):
        share = rng.choices(mix.classes, weights)[0]
        shape = share.scenario
        specs.append(
            RequestSpec(
                first_index + offset,
                make_prompt(shape.input_tokens, rng),
                shape.input_tokens,
                shape.output_tokens,
                share.service_tier,
            )
        )
    return specs


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``count`` requests at ``rate`` requests/s.

    As vLLM's ``vllm bench serve``: gaps are gamma-distributed with shape ``burstiness`` and
    mean 1/rate (burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular),
    and the cumulative times are rescaled so the last request goes at exactly count/rate, so
    runs with different seeds carry the same average load. An infinite rate sends at once.
    """
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if count == 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    gaps = [
        1.0 / rate
        if math.isinf(burstiness)
        else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        for _ in range(count)
    ]
    offsets = []
    total = 0.0
    for gap in gaps:
        total += gap
        offsets.append(total)
    scale = (count / rate) / total
    return [offset * scale for offset in offsets]
