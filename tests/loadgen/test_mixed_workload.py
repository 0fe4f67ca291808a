"""Mixed workloads: a request's SLO class, drawn by share, sent as OpenAI's service_tier."""

from __future__ import annotations

from collections import Counter

import pytest

from loadgen.client import StreamClient
from loadgen.scenarios import MIXED_SCENARIOS, SCENARIOS, ClassShare, MixedScenario
from loadgen.wire import ConnectionPool
from loadgen.workload import RequestSpec, build_mixed_requests

MIX = MIXED_SCENARIOS["chat-and-batch"]


def test_requests_follow_the_shares_and_their_class_shapes() -> None:
    specs = build_mixed_requests(400, MIX, seed=1)
    tiers = Counter(s.service_tier for s in specs)
    assert set(tiers) == {"priority", "flex"}
    assert 150 < tiers["priority"] < 250
    for spec in specs:
        shape = MIX.for_class("interactive" if spec.service_tier == "priority" else "batch")
        assert (spec.prompt_tokens, spec.max_tokens) == (shape.input_tokens, shape.output_tokens)
        assert len(spec.prompt.split()) == shape.input_tokens
    assert build_mixed_requests(400, MIX, seed=1) == specs


def test_a_mixed_scenario_checks_its_classes_and_shares() -> None:
    short = SCENARIOS["short"]
    with pytest.raises(ValueError, match="unknown SLO class"):
        ClassShare("urgent", short, 0.5)
    with pytest.raises(ValueError, match="add up to"):
        MixedScenario("m", (ClassShare("interactive", short, 0.5), ClassShare("batch", short, 0.4)))
    with pytest.raises(ValueError, match="distinct"):
        MixedScenario("m", (ClassShare("batch", short, 0.5), ClassShare("batch", short, 0.5)))


def test_the_client_sends_the_service_tier_only_when_the_request_has_one() -> None:
    client = StreamClient(ConnectionPool(), "http://127.0.0.1:1", "m")
    assert client.payload(RequestSpec(0, "a b", 2, 4, "flex"))["service_tier"] == "flex"
    assert "service_tier" not in client.payload(RequestSpec(0, "a b", 2, 4))
