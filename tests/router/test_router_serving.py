"""The serving figures of the router's stats report (common/serving.py, docs/router.md):
decisions and reasons as deltas per interval, TTFT and TPOT histograms over the interval,
and each deployment's engines as last scraped; and the reason header beside the route."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.serving import clean_serving, histogram_count, quantile_ms
from router.client.stream import REASON_HEADER, ROUTE_HEADER, ClientRequest, ClientStream
from router.engines.load import EngineSample
from router.metrics import RouterMetrics

MODEL = "tiny"


@dataclass
class FakeEngine:
    url: str
    role: str
    sample: EngineSample | None = None
    throughput_tps: float = 0.0
    itl_ms: float | None = None
    is_up: bool = True

    def available(self, now: float) -> bool:
        return self.is_up


@dataclass
class FakeSpec:
    id: int
    name: str
    model: str


@dataclass
class FakeDeployment:
    spec: FakeSpec
    gpu: FakeEngine
    cpu: FakeEngine | None = None
    extra: list[str] = field(default_factory=list)


def sample(
    at: float, tokens: float, buckets: list[tuple[float, float]], **kw: float
) -> EngineSample:
    return EngineSample(
        at=at,
        running=kw.get("running", 3),
        waiting=kw.get("waiting", 1),
        kv_usage=kw.get("kv", 0.25),
        generation_tokens=tokens,
        itl_sum=None,
        itl_count=None,
        avg_generation_tps=None,
        itl_buckets=tuple(buckets),
    )


def test_the_report_carries_interval_deltas_histograms_and_engine_figures() -> None:
    metrics = RouterMetrics()
    gpu = FakeEngine("http://gpu:7001", "gpu", throughput_tps=50.0, itl_ms=12.0)
    cpu = FakeEngine("http://cpu:7002", "cpu", itl_ms=40.0)
    dep = FakeDeployment(FakeSpec(7, "local-hetero", MODEL), gpu, cpu)
    other = FakeDeployment(FakeSpec(8, "other", "big"), FakeEngine("http://g2:7001", "gpu"))

    # The first report sets the engines' baseline: no TPOT yet, tokens/s from the scrapes.
    gpu.sample = sample(10.0, 1000, [(0.01, 10), (0.05, 20), (float("inf"), 20)])
    cpu.sample = sample(10.0, 0, [(0.01, 0), (0.05, 0), (float("inf"), 0)], running=0, kv=0.0)
    first = metrics.stats(3, [dep, other])["serving"]
    assert isinstance(first, dict)
    assert first["tpot_ms"] == {} and first["decisions"] == {}
    engines = first["deployments"][0]["engines"]
    assert engines[0] == {
        "role": "gpu",
        "url": "http://gpu:7001",
        "up": True,
        "running": 3,
        "waiting": 1,
        "kv_usage_perc": 25.0,
        "tokens_per_second": 50.0,
        "itl_ms": 12.0,
    }
    assert first["deployments"][1]["engines"][0]["running"] is None  # never scraped

    # One interval: three requests of the model, one of another, their reasons and TTFTs.
    for route, reason, ttft in (("pd", "short-prompt", 0.08), ("gpu-only", "gpu-room", 0.02)):
        metrics.decision("new", route, reason)
        metrics.observe_ttft(route, ttft, MODEL)
        metrics.count_request(route, "ok", MODEL)
    metrics.decision("new", "pd", "short-prompt")
    metrics.observe_ttft("pd", 0.4, MODEL)
    metrics.count_request("pd", "ok", MODEL)
    metrics.decision("chunk", "cpu-only", "cpu-room")  # a chunk decision is no request
    metrics.count_request("gpu-only", "ok", "big")
    gpu.sample = sample(20.0, 1600, [(0.01, 40), (0.05, 60), (float("inf"), 60)])
    cpu.sample = sample(20.0, 200, [(0.01, 0), (0.05, 100), (float("inf"), 100)])
    report = metrics.stats(3, [dep, other])
    serving = report["serving"]
    assert isinstance(serving, dict)
    assert clean_serving(serving) == serving  # the control plane takes it as it is
    assert serving["decisions"] == {"pd": 2, "gpu-only": 2}
    assert serving["reasons"] == {"pd:short-prompt": 2, "gpu-only:gpu-room": 1}
    mine = serving["deployments"][0]
    assert (mine["id"], mine["name"], mine["model"]) == (7, "local-hetero", MODEL)
    assert mine["decisions"] == {"pd": 2, "gpu-only": 1}
    assert histogram_count(mine["ttft_ms"]) == 3 and histogram_count(serving["ttft_ms"]) == 3
    assert 10 < quantile_ms(mine["ttft_ms"], 0.5) <= 100  # the 80 ms one
    assert 300 <= quantile_ms(mine["ttft_ms"], 0.99) <= 500
    # TPOT: the engines' ITL histograms since the last report (30 + 100 gaps), both engines.
    assert mine["tpot_ms"] == {"10": 30, "50": 110}
    assert serving["tpot_ms"] == {"10": 30, "50": 110}
    assert quantile_ms(mine["tpot_ms"], 0.5) > 10
    # Tokens/s over the interval from the engines' token counters: 600 / 10 s, 200 / 10 s.
    assert [e["tokens_per_second"] for e in mine["engines"]] == [60.0, 20.0]
    assert serving["interval_seconds"] >= 0
    # The cumulative figures stay as they were.
    assert report["decisions"] == {"gpu-only": 2, "pd": 2, "cpu-only": 0, "rejected": 0}

    # The next interval starts empty.
    after = metrics.stats(3, [dep])["serving"]
    assert isinstance(after, dict)
    assert after["decisions"] == {} and after["reasons"] == {} and after["ttft_ms"] == {}
    assert after["tpot_ms"] == {}


def test_an_engine_restart_leaves_no_negative_counts() -> None:
    metrics = RouterMetrics()
    gpu = FakeEngine("http://gpu:7001", "gpu", throughput_tps=5.0)
    dep = FakeDeployment(FakeSpec(1, "d", MODEL), gpu)
    gpu.sample = sample(10.0, 1000, [(0.01, 50), (float("inf"), 60)])
    metrics.stats(1, [dep])
    gpu.sample = sample(20.0, 10, [(0.01, 1), (float("inf"), 2)])
    serving = metrics.stats(1, [dep])["serving"]
    assert isinstance(serving, dict)
    assert serving["tpot_ms"] == {}
    assert serving["deployments"][0]["engines"][0]["tokens_per_second"] == 5.0


def test_the_answer_names_its_route_and_reason() -> None:
    req = ClientRequest(
        path="/v1/chat/completions",
        chat=True,
        body={},
        raw=b"",
        model=MODEL,
        stream=True,
        include_usage=False,
        max_tokens=4,
        received_at=0.0,
    )
    out = ClientStream(None, req, RouterMetrics())  # type: ignore[arg-type]
    assert out.route_headers() == {ROUTE_HEADER: "gpu-only"}
    out.decision_label, out.decision_reason = "pd", "short-prompt"
    assert out.route_headers() == {ROUTE_HEADER: "pd", REASON_HEADER: "short-prompt"}
    whole = out.whole(b"{}", 200, "application/json")
    assert whole.headers[REASON_HEADER] == "short-prompt"
