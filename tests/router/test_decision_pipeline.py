"""The decision pipeline (router/decide/pipeline.py): its steps run in the order docs/router.md
lists, each gives its own verdict and reason code, the overrides that lived in the request
path still win where they did, and every reason code is documented once."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from common.decisions import SHED_CODES, Code, Mode, Route
from common.policy_schema import MODES, PolicyKnobs
from common.routing import DeploymentSpec
from controlplane.routers.choices import DECISIONS
from router.client.stream import ClientRequest
from router.decide import (
    NEW_REQUEST,
    NEXT_CHUNK,
    REPLICA,
    Ask,
    Decision,
    Loads,
    ReplicaAsk,
    choose_replica,
    decide,
)
from router.engines.load import UNAVAILABLE, DeviceLoad
from router.metrics import SHED_REASONS
from router.plan import plan
from router.state import Router, ServerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "router.md"
IDLE_GPU = DeviceLoad(True, 0, 0, 5.0, 0.0, None)
IDLE_CPU = DeviceLoad(True, 0, 0, 0.0, 0.0, None)
# The GPU with requests in its own queue (saturated), and a CPU measured well within target.
QUEUED_GPU = replace(IDLE_GPU, running=20, waiting=2)
MEASURED_CPU = replace(IDLE_CPU, running=1, itl_ms=40.0, itl_batch=1.0)
HOT = 95.0


def knobs(**kw: object) -> PolicyKnobs:
    return replace(PolicyKnobs(), **kw)  # type: ignore[arg-type]


def documented(marker: str) -> list[str]:
    """The step names of the numbered list after ``<!-- pipeline: marker -->``, up to the
    next paragraph that starts a sentence (a lower-case one, such as "then the overrides",
    goes on with the list)."""
    text = DOC.read_text()
    match = re.search(rf"<!-- pipeline: {marker} -->\n(.*?)\n\n(?=[A-Z#<])", text, re.S)
    assert match is not None, marker
    return re.findall(r"^\d+\. `([a-z0-9-]+)`", match[1], re.M)


def test_the_pipelines_run_in_the_order_the_docs_list() -> None:
    assert documented("REPLICA") == [name for name, _ in REPLICA]
    assert documented("NEW_REQUEST") == list(NEW_REQUEST.names)
    assert documented("NEXT_CHUNK") == list(NEXT_CHUNK.names)


def test_the_docs_list_every_reason_code_and_no_other() -> None:
    text = DOC.read_text()
    match = re.search(r"<!-- codes -->\n(.*?)\n\n", text, re.S)
    assert match is not None
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", match[1], re.M)
    assert sorted(listed) == sorted(code.value for code in Code)
    assert len(listed) == len(set(listed))


def test_metrics_and_the_control_plane_take_their_values_from_the_enumerations() -> None:
    assert tuple(code.value for code in SHED_CODES) == SHED_REASONS
    assert DECISIONS == ("gpu-only", "pd", "cpu-only", "rejected")
    assert MODES == ("auto", "gpu-only", "cpu-only", "forced-pd")
    # The wire keeps the strings: a member is its value.
    assert f"{Route.PD}:{Code.GPU_KNEE}" == "pd:gpu-knee" and str(Mode.CPU_ONLY) == "cpu-only"


# -- each step's verdict and reason -------------------------------------------------------


@dataclass(frozen=True)
class Case:
    ask: Ask
    step: str
    route: Route
    code: Code


NEW_CASES = {
    "mode-cpu-only": Case(
        Ask(knobs(mode="cpu-only"), Loads(IDLE_GPU, IDLE_CPU)),
        "mode-cpu-only",
        Route.CPU_ONLY,
        Code.MODE,
    ),
    "mode-cpu-only, CPU down": Case(
        Ask(knobs(mode="cpu-only"), Loads(IDLE_GPU, UNAVAILABLE)),
        "mode-cpu-only",
        Route.REJECTED,
        Code.CPU_DOWN,
    ),
    "gpu-down": Case(
        Ask(knobs(), Loads(UNAVAILABLE, IDLE_CPU)), "gpu-down", Route.CPU_ONLY, Code.GPU_DOWN
    ),
    "offload-off": Case(
        Ask(knobs(mode="gpu-only"), Loads(QUEUED_GPU, MEASURED_CPU)),
        "offload-off",
        Route.GPU_ONLY,
        Code.OFFLOAD_OFF,
    ),
    "mode-forced-pd": Case(
        Ask(knobs(mode="forced-pd"), Loads(IDLE_GPU, IDLE_CPU)),
        "mode-forced-pd",
        Route.PD,
        Code.MODE,
    ),
    "syshax-threshold": Case(
        Ask(knobs(algorithm="syshax-threshold"), Loads(IDLE_GPU, IDLE_CPU)),
        "syshax-threshold",
        Route.GPU_ONLY,
        Code.GPU_ROOM,
    ),
    "class-cpu-first": Case(
        Ask(
            knobs(class_aware=True),
            Loads(QUEUED_GPU, MEASURED_CPU),
            PolicyKnobs().slo_class("batch"),
            prompt_tokens=10,
        ),
        "class-cpu-first",
        Route.PD,  # its prefill on the GPU: the busy CPU's first token is not yet measured
        Code.CLASS_CPU_FIRST,
    ),
    "capacity": Case(
        Ask(knobs(), Loads(QUEUED_GPU, MEASURED_CPU)), "capacity", Route.PD, Code.GPU_QUEUE
    ),
}


@pytest.mark.parametrize("case", NEW_CASES.values(), ids=NEW_CASES.keys())
def test_each_new_request_step_gives_its_verdict_and_reason(case: Case) -> None:
    decision, step = NEW_REQUEST.judge(case.ask)
    assert (step, decision.route, decision.code) == (case.step, case.route, case.code)
    assert decision.reason


SLOW_CPU = replace(IDLE_CPU, running=1, itl_ms=500.0, itl_batch=1.0)
CHUNK_CASES = {
    "cpu-down": Case(
        Ask(knobs(), Loads(IDLE_GPU, UNAVAILABLE)), "cpu-down", Route.GPU_ONLY, Code.CPU_DOWN
    ),
    "pinned": Case(
        Ask(knobs(mode="forced-pd"), Loads(IDLE_GPU, MEASURED_CPU)), "pinned", Route.PD, Code.STAY
    ),
    "offload-off": Case(
        Ask(knobs(mode="gpu-only"), Loads(IDLE_GPU, MEASURED_CPU)),
        "offload-off",
        Route.GPU_ONLY,
        Code.OFFLOAD_OFF,
    ),
    "cpu-misses": Case(
        Ask(knobs(), Loads(replace(IDLE_GPU, running=3), SLOW_CPU)),
        "cpu-misses",
        Route.GPU_ONLY,
        Code.BACK_CPU_SLOW,
    ),
    "class-stays": Case(
        Ask(
            knobs(class_aware=True), Loads(IDLE_GPU, MEASURED_CPU), PolicyKnobs().slo_class("batch")
        ),
        "class-stays",
        Route.PD,
        Code.STAY,
    ),
    "idle-gpu": Case(
        Ask(knobs(), Loads(IDLE_GPU, MEASURED_CPU)), "idle-gpu", Route.GPU_ONLY, Code.BACK
    ),
    "stay": Case(Ask(knobs(), Loads(QUEUED_GPU, MEASURED_CPU)), "stay", Route.PD, Code.STAY),
}


@pytest.mark.parametrize("case", CHUNK_CASES.values(), ids=CHUNK_CASES.keys())
def test_each_chunk_step_gives_its_verdict_and_reason(case: Case) -> None:
    decision, step = NEXT_CHUNK.judge(case.ask)
    assert (step, decision.route, decision.code) == (case.step, case.route, case.code)


def test_the_replica_choice_is_the_least_pressured_the_first_of_equals() -> None:
    @dataclass
    class Replica:
        load: float

        def pressure(self, now: float) -> float:
            return self.load

    a, b, c = Replica(3.0), Replica(1.0), Replica(1.0)
    for choice in ("least-loaded", "prefix"):
        ask = ReplicaAsk(knobs(replica_choice=choice))  # nothing matched: load alone
        assert choose_replica([a, b, c], 0.0, ask) == (b, Code.LEAST_LOADED)
        assert choose_replica([a], 0.0, ask) == (a, Code.LEAST_LOADED)


@dataclass
class Loaded:
    load: float

    def pressure(self, now: float) -> float:
        return self.load


@pytest.mark.parametrize(
    ("loads", "held", "given", "chosen", "code"),
    [
        # The replica holding the prefix, though busier, within the slack (4 by default).
        ([0.0, 3.0, 1.0], [0, 900, 300], {}, 1, Code.PREFIX_HIT),
        # The longest match wins; equal matches go to the less pressured.
        ([0.0, 2.0, 1.0], [0, 600, 600], {}, 2, Code.PREFIX_HIT),
        # Past the slack it is passed over: load decides.
        ([0.0, 5.0, 1.0], [0, 900, 0], {}, 0, Code.LEAST_LOADED),
        # A match shorter than prefix_min_tokens does not count.
        ([0.0, 1.0], [0, 200], {}, 0, Code.LEAST_LOADED),
        ([0.0, 1.0], [0, 200], {"prefix_min_tokens": 128}, 1, Code.PREFIX_HIT),
        # A slack of 0: only a replica as idle as the least loaded may win on its prefix.
        ([1.0, 2.0, 1.0], [0, 900, 400], {"prefix_load_slack": 0.0}, 2, Code.PREFIX_HIT),
        # least-loaded turns the step off.
        ([0.0, 1.0], [0, 900], {"replica_choice": "least-loaded"}, 0, Code.LEAST_LOADED),
    ],
)
def test_the_prefix_choice_weighs_the_prefix_held_against_load(
    loads: list[float], held: list[int], given: dict[str, Any], chosen: int, code: Code
) -> None:
    replicas = [Loaded(load) for load in loads]
    ask = ReplicaAsk(knobs(**given), held)
    assert choose_replica(replicas, 0.0, ask) == (replicas[chosen], code)


# -- the overrides win where they did ------------------------------------------------------

PD_ASK = Ask(knobs(mode="forced-pd"), Loads(IDLE_GPU, IDLE_CPU))


@pytest.mark.parametrize(
    ("given", "step", "code"),
    [
        ({"choices": 2}, "n-above-1", Code.N_ABOVE_1),
        ({"has_cpu": False}, "no-cpu", Code.NO_CPU),
        (
            {"unspliceable": lambda: "logprobs across engines"},
            "not-spliceable",
            Code.NOT_SPLICEABLE,
        ),
    ],
)
def test_an_override_turns_a_pd_verdict_gpu_only(
    given: dict[str, object], step: str, code: Code
) -> None:
    decision, by = NEW_REQUEST.judge(replace(PD_ASK, **given))  # type: ignore[arg-type]
    assert (by, decision.route, decision.code) == (step, Route.GPU_ONLY, code)


def test_overrides_leave_other_routes_alone_and_ask_nothing_they_need_not() -> None:
    asked: list[bool] = []

    def unspliceable() -> str | None:
        asked.append(True)
        return "never spliced"

    ask = Ask(
        knobs(), Loads(IDLE_GPU, IDLE_CPU), choices=4, has_cpu=False, unspliceable=unspliceable
    )
    decision, step = NEW_REQUEST.judge(ask)
    assert (step, decision.route, decision.code) == (
        "capacity",
        Route.GPU_ONLY,
        Code.GPU_ROOM,
    )
    assert asked == []  # only a PD verdict asks the protocol
    # n > 1 wins first: the protocol is not asked about a verdict already gpu-only.
    assert NEW_REQUEST.run(replace(ask, knobs=knobs(mode="forced-pd"))).code is Code.N_ABOVE_1
    assert asked == []


def test_a_forced_mode_is_held_to_the_hard_limits_last() -> None:
    hot = Loads(IDLE_GPU, IDLE_CPU, gpu_temperature_c=HOT)
    ask = Ask(knobs(mode="gpu-only", gpu_max_temperature_c=90.0), hot, forced=True)
    decision, step = NEW_REQUEST.judge(ask)
    assert (step, decision.route, decision.code) == (
        "forced-limits",
        Route.REJECTED,
        Code.GPU_HOT,
    )
    assert decision.status == 429
    # The policy's own gpu-only mode on the same GPU is not a forced one.
    assert NEW_REQUEST.run(replace(ask, forced=False)).route is Route.GPU_ONLY
    # n > 1 turned a forced PD gpu-only; the hot GPU then refuses that too.
    forced_pd = replace(ask, knobs=knobs(mode="forced-pd", gpu_max_temperature_c=90.0), choices=2)
    assert NEW_REQUEST.run(forced_pd).code is Code.GPU_HOT


def test_decide_on_loads_alone_is_the_pipeline_with_nothing_ruled_out() -> None:
    loads = Loads(QUEUED_GPU, MEASURED_CPU)
    assert decide(knobs(), loads) == NEW_REQUEST.run(Ask(knobs(), loads))
    assert NEW_REQUEST.judge(Ask(knobs(), loads))[1] == "capacity"


# -- through the request path's planning ---------------------------------------------------


def request(mode: str | None, **body: object) -> ClientRequest:
    return ClientRequest(
        path="/v1/completions",
        chat=False,
        body={"model": "m", "prompt": "hi", **body},
        raw=b'{"model": "m", "prompt": "hi"}',
        model="m",
        stream=False,
        include_usage=False,
        max_tokens=None,
        received_at=0.0,
        mode_header=mode,
    )


def test_planning_a_request_hands_the_pipeline_what_the_request_and_deployment_rule_out() -> None:
    async def check() -> list[Decision]:
        router = Router(ServerConfig())
        cool, hot = (
            DeploymentSpec(i, f"d{i}", "m", "default", "vllm", f"{url}1", f"{url}2", **given)
            for i, url, given in (
                (1, "http://127.0.0.1:910", {}),
                (2, "http://127.0.0.1:920", {"gpu_temperature_c": HOT}),
            )
        )
        router.state.set_deployments([cool, hot])
        first, second = router.state.deployments
        try:
            return [
                plan(router, request("forced-pd"), first, count=False)[0],
                plan(router, request("forced-pd", n=3), first, count=False)[0],
                plan(router, request("gpu-only"), second, count=False)[0],
                plan(router, request(None), second, count=False)[0],
            ]
        finally:
            await router.state.close()

    pd, n3, forced_gpu, policy = asyncio.run(check())
    assert (pd.route, pd.code) == (Route.PD, Code.MODE)
    assert (n3.route, n3.code) == (Route.GPU_ONLY, Code.N_ABOVE_1)
    # The default gpu_max_temperature_c is below HOT: a forced gpu-only is refused there,
    # while the policy's own decision on the same GPU offloads.
    assert (forced_gpu.route, forced_gpu.code) == (Route.REJECTED, Code.GPU_HOT)
    assert (policy.route, policy.code) == (Route.PD, Code.GPU_HOT)
