from __future__ import annotations

import json
import threading

import pytest
from django_celery_beat.models import PeriodicTask

from controlplane.benchmarks import analysis, runner, schedules, services
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample, Scenario
from controlplane.inventory.models import Heartbeat
from loadgen.simproc import running_sim


def summary(*rows: tuple[str, int, float, float, float, float]) -> dict:
    """rows of (mode, concurrency, throughput, ttft mean, tpot mean, e2e p99)."""
    return {
        "rows": [
            {
                "mode": m,
                "concurrency": c,
                "summary": {
                    "output_throughput": tput,
                    "failed": 0,
                    "ttft": {"mean": ttft, "p99": ttft * 1.5},
                    "tpot": {"mean": tpot, "p99": tpot * 1.5},
                    "e2e": {"p99": e2e},
                },
            }
            for m, c, tput, ttft, tpot, e2e in rows
        ]
    }


DOCUMENTED = summary(
    ("cpu", 8, 32.6, 892, 30.7, 4561),
    ("gpu", 8, 158.2, 146, 6.3, 1815),
    ("hetero", 8, 217.8, 153, 4.6, 150),
)


def test_the_builtin_scenarios_are_those_of_the_mission(db) -> None:
    shapes = {
        s.name: (s.input_tokens, s.output_tokens, s.concurrency_min, s.concurrency_max)
        for s in Scenario.objects.filter(builtin=True)
    }
    assert shapes == {
        "short": (128, 256, 1, 16),
        "medium": (512, 1024, 1, 8),
        "long": (2048, 512, 1, 4),
    }


def test_an_unknown_scenario_is_rejected(admin_client) -> None:
    response = admin_client.post(
        "/api/v1/benchmark-runs/",
        {"scenario": "enormous", "target_url": "http://127.0.0.1:7010", "concurrency": 8},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "scenario: unknown scenario 'enormous'"


@pytest.mark.parametrize(
    ("given", "stored"),
    [(8, [8]), ("1-4", [1, 2, 3, 4]), ("1,2,4,8", [1, 2, 4, 8]), ([16, 2], [2, 16])],
)
def test_concurrency_may_be_a_number_list_or_range(
    admin_client, given, stored, django_capture_on_commit_callbacks
) -> None:
    with django_capture_on_commit_callbacks() as callbacks:
        response = admin_client.post(
            "/api/v1/benchmark-runs/",
            {"scenario": "short", "target_url": "http://127.0.0.1:7010", "concurrency": given},
            format="json",
        )
    assert response.status_code == 201, response.content
    assert response.json()["concurrency"] == stored
    assert len(callbacks) == 1


@pytest.mark.parametrize("given", [0, "8-1", "a,b", 5000, [True]])
def test_bad_concurrency_names_the_limit(admin_client, given) -> None:
    response = admin_client.post(
        "/api/v1/benchmark-runs/",
        {"scenario": "short", "target_url": "http://127.0.0.1:7010", "concurrency": given},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("concurrency:")


def test_regressions_are_changes_worse_than_the_threshold() -> None:
    slower = summary(("hetero", 8, 190.0, 150, 5.5, 160))
    changes = analysis.compare_to_baseline(slower, DOCUMENTED, threshold_percent=10)
    assert [(c.figure, c.change_percent) for c in changes] == [
        ("throughput_tok_s", 12.76),
        ("tpot_mean_ms", 19.57),
    ]
    assert analysis.compare_to_baseline(slower, DOCUMENTED, threshold_percent=20) == []
    assert analysis.compare_to_baseline(DOCUMENTED, DOCUMENTED, threshold_percent=0) == []


def test_the_advisor_follows_the_guidance_table_from_measured_figures() -> None:
    assert analysis.advise([DOCUMENTED], "latency").mode == "gpu"
    best = analysis.advise([DOCUMENTED], "throughput", cpu_max_batch_size=8)
    assert best.mode == "hetero"
    assert best.policy == {"mode": "auto", "enable_auto_pd_offload": True, "cpu_max_batch_size": 8}
    assert "217.8 tok/s" in best.reason
    # Hetero's higher throughput at p99 is not a goodput gain: an SLO needs a sweep for it.
    unswept = analysis.advise([DOCUMENTED], "slo", ttft_slo_ms=250, tpot_slo_ms=8)
    assert unswept.mode is None
    assert unswept.reason == (
        "only hetero meets the SLO at p99 in these runs "
        "(hetero is recommended for an SLO only from a goodput sweep at it)"
    )
    looser = analysis.advise([DOCUMENTED], "slo", ttft_slo_ms=250, tpot_slo_ms=20)
    assert looser.mode == "gpu" and "only from a goodput sweep" in looser.reason
    assert analysis.advise([DOCUMENTED], "slo", ttft_slo_ms=100).mode is None
    only_cpu = summary(("cpu", 4, 30.0, 900, 31, 5000))
    assert analysis.advise([only_cpu], "latency").mode == "cpu"
    assert analysis.advise([], "throughput").mode is None
    with pytest.raises(ValueError, match="goal must be one of"):
        analysis.advise([DOCUMENTED], "cheapest")


def sweep_summary(gpu: dict[float, float], hetero: dict[float, float], slo: dict) -> dict:
    """A stored goodput sweep: per mode, {rate: attainment %} of 100 requests each."""

    def points(attainment: dict[float, float]) -> list[dict]:
        return [
            {"rate": r, "requests": 100, "good": round(a), "duration_s": 100 / r,
             "output_tokens": 1000, "bisection": False}
            for r, a in attainment.items()
        ]  # fmt: skip

    return {
        "config": {"slo_ms": slo},
        "rows": [],
        "sweeps": {
            "gpu": {"target": 90.0, "points": points(gpu)},
            "hetero": {"target": 90.0, "points": points(hetero)},
        },
    }


def test_the_advisor_recommends_hetero_only_from_a_goodput_gain_at_that_slo() -> None:
    slo = {"ttft": 5000.0, "tpot": 150.0}
    gain = sweep_summary(
        {1.0: 100, 2.0: 95, 3.0: 60, 4.0: 20}, {1.0: 100, 2.0: 99, 3.0: 93, 4.0: 50}, slo
    )
    advice = analysis.advise([gain], "slo", ttft_slo_ms=5000.0, tpot_slo_ms=150.0)
    assert advice.mode == "hetero"
    assert "hetero sustains 3 req/s, GPU-only 2 (+50 %)" in advice.reason
    assert "hetero pays above 2 req/s" in advice.reason  # 99 % vs 95 % at 2 req/s
    assert advice.figures["hetero"]["crossover_rps"] == 2.0
    assert advice.figures["gpu"]["max_goodput_rps"] == 2.0
    # A tie is no reason to run a second engine.
    tie = sweep_summary({1.0: 100, 2.0: 95, 3.0: 60}, {1.0: 100, 2.0: 96, 3.0: 61}, slo)
    same = analysis.advise([tie], "slo", ttft_slo_ms=5000.0, tpot_slo_ms=150.0)
    assert same.mode == "gpu" and "the CPU adds no goodput here" in same.reason
    # A sweep at another SLO says nothing about this one; the newest sweep at it decides.
    elsewhere = analysis.advise([gain], "slo", ttft_slo_ms=5000.0, tpot_slo_ms=100.0)
    assert elsewhere.mode is None and "crossover" not in str(elsewhere.figures)
    assert analysis.advise([gain, tie], "slo", ttft_slo_ms=5000.0, tpot_slo_ms=150.0).mode == (
        "gpu"
    )
    nothing = sweep_summary({1.0: 10}, {1.0: 20}, slo)
    none = analysis.advise([nothing], "slo", ttft_slo_ms=5000.0, tpot_slo_ms=150.0)
    assert none.mode is None and "no measured rate meets the SLO" in none.reason


def test_compare_and_advisor_endpoints(admin_client, make_deployment) -> None:
    deployment = make_deployment()
    scenario = Scenario.objects.get(name="short")
    runs = [
        BenchmarkRun.objects.create(
            scenario=scenario, deployment=deployment, status="succeeded", summary=DOCUMENTED
        )
        for _ in range(2)
    ]
    body = admin_client.get(f"/api/v1/benchmark-runs/compare?ids={runs[0].pk},{runs[1].pk}").json()
    assert [len(run["rows"]) for run in body["runs"]] == [3, 3]
    assert body["runs"][0]["rows"][1]["throughput_tok_s"] == 158.2
    assert admin_client.get("/api/v1/benchmark-runs/compare?ids=999").status_code == 400
    advice = admin_client.get(f"/api/v1/advisor?goal=throughput&deployment={deployment.pk}").json()
    assert advice["mode"] == "hetero" and advice["runs_considered"] == 2
    assert advice["figures"]["gpu"]["ttft_mean_ms"] == 146
    bad = admin_client.get("/api/v1/advisor?goal=slo")
    assert bad.status_code == 400 and "ttft_slo_ms" in bad.json()["error"]["message"]


def test_a_broken_schedule_is_disabled_not_fatal(db, make_deployment) -> None:
    from controlplane.benchmarks.tasks import scheduled_run

    deployment = make_deployment()
    good = schedules.create_schedule("nightly", deployment=deployment, scenario="short")
    assert json.loads(good.kwargs)["deployment"] == deployment.name
    broken = PeriodicTask.objects.create(
        name="broken",
        task=schedules.TASK_NAME,
        interval=_interval(),
        kwargs=json.dumps({"deployment": "nope"}),
    )
    result = scheduled_run.apply(
        kwargs={"deployment": "nope"}, headers={"periodic_task_name": "broken"}
    )
    assert result.successful() and result.result is None
    broken.refresh_from_db()
    assert broken.enabled is False
    assert "no deployment named 'nope'" in broken.description
    with pytest.raises(schedules.ScheduleError, match="mode: must be one of"):
        schedules.create_schedule("bad", deployment=deployment, mode="turbo")


def _interval():
    from django_celery_beat.models import IntervalSchedule

    return IntervalSchedule.objects.create(every=1, period=IntervalSchedule.DAYS)


def test_a_scheduled_run_is_compared_with_the_baseline_and_flagged(db, make_deployment) -> None:
    deployment = make_deployment()
    scenario = Scenario.objects.get(name="short")
    BenchmarkRun.objects.create(
        scenario=scenario,
        deployment=deployment,
        status="succeeded",
        summary=DOCUMENTED,
        is_baseline=True,
    )
    current = BenchmarkRun.objects.create(
        scenario=scenario,
        deployment=deployment,
        status="succeeded",
        summary=summary(("hetero", 8, 150.0, 153, 4.6, 150)),
    )
    assert services.flag_regression(current, 10.0) is True
    assert current.regression_detail["changes"][0]["figure"] == "throughput_tok_s"


def test_metrics_expose_fleet_state_and_regressions(
    admin_client, anonymous_client, make_deployment
) -> None:
    deployment = make_deployment(state="running")
    BenchmarkRun.objects.create(
        scenario=Scenario.objects.get(name="short"),
        deployment=deployment,
        status="succeeded",
        regression=True,
        finished_at="2026-01-01T00:00:00Z",
    )
    assert anonymous_client.get("/api/v1/metrics").status_code == 401
    text = admin_client.get("/api/v1/metrics").content.decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("syshax_deployments", (("state", "running"),))] == 1
    key = ("syshax_benchmark_regression", (("deployment", deployment.name), ("scenario", "short")))
    assert samples[key] == 1
    assert samples[("syshax_policy_version", (("policy", "default"),))] == 1


@pytest.fixture
def simulated_gpu():
    with running_sim("a100-80gb", speed=20.0, seed=1, startup_timeout_s=30) as url:
        yield url


@pytest.mark.django_db(transaction=True)
def test_a_run_measures_a_real_engine_and_stores_summary_and_samples(
    simulated_gpu, make_deployment
) -> None:
    deployment = make_deployment()
    scenario = Scenario.objects.create(name="tiny", input_tokens=16, output_tokens=64)
    run = BenchmarkRun.objects.create(
        scenario=scenario,
        target_url=simulated_gpu,
        deployment=deployment,
        mode="gpu",
        concurrency=[1, 4],
        iterations=6,
        warmup=1,
    )
    stop = threading.Event()

    def heartbeat() -> None:  # the node's agent, reporting while the load runs
        while not stop.wait(0.005):
            Heartbeat.objects.create(node=deployment.node, cpu_percent=12.0)

    beats = threading.Thread(target=heartbeat)
    beats.start()
    try:
        assert runner.execute(run.pk) == "succeeded"
    finally:
        stop.set()
        beats.join()
    assert runner.execute(run.pk) == "succeeded"  # a redelivery does nothing more
    run.refresh_from_db()
    assert run.progress == 1.0 and run.error == ""
    assert [(row["mode"], row["concurrency"]) for row in run.summary["rows"]] == [
        ("gpu", 1),
        ("gpu", 4),
    ]
    assert run.summary["rows"][0]["summary"]["completed"] == 6
    samples = BenchmarkSample.objects.filter(run=run)
    assert samples.count() == 12
    assert all(s.ok and s.output_tokens == 64 and s.ttft_ms > 0 for s in samples)
    assert run.summary["rows"][0]["resources"]["cpu_percent_mean"] == 12.0
    # The node's heartbeat inside the first row's window is that row's resource use.
    assert run.summary["rows"][0]["resources"]["cpu_percent_mean"] == 12.0


@pytest.mark.django_db(transaction=True)
def test_a_sweep_run_stores_every_rate_and_the_search(
    simulated_gpu, admin_client, admin_user, client
) -> None:
    Scenario.objects.create(name="tiny-sweep", input_tokens=16, output_tokens=16)
    body = {
        "scenario": "tiny-sweep",
        "target_url": simulated_gpu,
        "mode": "gpu",
        "request_rates": "4,8",
        "slo_ttft_ms": 60000,
        "iterations": 5,
    }
    created = admin_client.post("/api/v1/benchmark-runs/", body, content_type="application/json")
    assert created.status_code == 201, created.content
    run_id = created.json()["id"]
    assert created.json()["request_rates"] == [4.0, 8.0]
    assert runner.execute(run_id) == "succeeded", BenchmarkRun.objects.get(pk=run_id).error
    run = BenchmarkRun.objects.get(pk=run_id)
    sweep = run.summary["sweeps"]["gpu"]
    assert [p["rate"] for p in sweep["points"]] == [4.0, 8.0]
    assert sweep["max_goodput_rate"] == 8.0 and not sweep["saturated"]
    assert run.summary["config"]["slo_ms"] == {"ttft": 60000.0, "tpot": None}
    assert [row["rate"] for row in run.summary["rows"]] == [4.0, 8.0]
    rates = sorted(
        set(BenchmarkSample.objects.filter(run=run).values_list("request_rate", flat=True))
    )
    assert rates == [4.0, 8.0]
    assert BenchmarkSample.objects.filter(run=run).count() == 10
    client.force_login(admin_user)
    page = client.get(f"/benchmarks/{run_id}/")
    assert page.status_code == 200
    assert b"<svg" in page.content and b"max goodput" in page.content


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"request_rates": "8,4"}, "request_rates", "strictly ascending"),
        ({"request_rates": [0, 1]}, "request_rates", "must be positive"),
        ({"request_rates": "1,2", "slo_ttft_ms": None}, "slo_ttft_ms", "needs slo_ttft_ms"),
        ({"slo_attainment": 0}, "slo_attainment", "greater than or equal to 0.001"),
        ({"slo_attainment": 101}, "slo_attainment", "less than or equal to 100"),
        (
            {"request_rates": "1,2", "iterations": 100000, "find_max_goodput": True},
            "iterations",
            "6 rates",
        ),
    ],
)
def test_bad_sweeps_are_refused_naming_the_field(
    admin_client, change: dict, field: str, words: str
) -> None:
    body = {
        "scenario": "short",
        "target_url": "http://127.0.0.1:9",
        "mode": "all",
        "request_rates": "1,2",
        "slo_ttft_ms": 1000,
        **change,
    }
    body = {k: v for k, v in body.items() if v is not None}
    answer = admin_client.post("/api/v1/benchmark-runs/", body, content_type="application/json")
    assert answer.status_code == 400, answer.content
    message = answer.json()["error"]["message"]
    assert field in message and words in message, message


@pytest.mark.django_db(transaction=True)
def test_a_run_against_nothing_fails_with_every_request_counted() -> None:
    scenario = Scenario.objects.create(name="tiny2", input_tokens=4, output_tokens=4)
    run = BenchmarkRun.objects.create(
        scenario=scenario,
        target_url="http://127.0.0.1:9",
        mode="gpu",
        concurrency=[1],
        iterations=3,
    )
    assert runner.execute(run.pk) == "failed"
    run.refresh_from_db()
    assert run.status == "failed" and run.error


@pytest.mark.django_db(transaction=True)
def test_a_run_sends_the_router_api_key_to_a_configured_router_only(
    simulated_gpu, settings
) -> None:
    from django.utils import timezone

    from controlplane.access.models import MachineCredential
    from controlplane.routers.models import RouterInstance
    from loadgen.simproc import running_router

    settings.ROUTER_API_KEY = "sxk_user"
    settings.ROUTER_BENCHMARK_KEY = "sxk_bench"  # sent in its place: it may force the mode
    scenario = Scenario.objects.create(name="tiny3", input_tokens=8, output_tokens=4)
    extra = ("--api-key", "sxk_user", "--benchmark-key", "sxk_bench")
    with running_router(simulated_gpu, simulated_gpu, mode="gpu-only", extra_args=extra) as url:
        RouterInstance.objects.create(
            name="r-key",
            credential=MachineCredential.issue("router", "r-key")[0],
            listen_url=url,
            last_seen_at=timezone.now(),
        )
        assert runner.router_api_key(url) == ""  # registered, not configured: no key
        settings.ROUTER_URLS = [url]
        assert runner.router_api_key(url + "/") == "sxk_bench"
        assert runner.router_api_key(simulated_gpu) == ""  # an engine never gets it
        run = BenchmarkRun.objects.create(
            scenario=scenario, target_url=url, mode="gpu", concurrency=[1], iterations=2
        )
        assert runner.execute(run.pk) == "succeeded", BenchmarkRun.objects.get(pk=run.pk).error
