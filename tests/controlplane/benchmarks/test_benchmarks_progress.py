"""A benchmark run reports as it goes: its phase, its points stored as each finishes, an ETA;
a cancel keeps the finished points; every run records the policy revision it ran under; the
admin and schedules share the dashboard's defaults. The load generator is replaced by a fake
``measure`` that hands the runner rows, as the real one does, so nothing is started."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.admin.sites import site
from django.test import RequestFactory
from django_celery_beat.models import PeriodicTask

from controlplane.benchmarks import analysis, runner, schedules, services
from controlplane.benchmarks.admin import run_benchmark
from controlplane.benchmarks.choices import DEFAULT_CONCURRENCY, DEFAULT_ITERATIONS
from controlplane.benchmarks.measure import Cancelled, Hooks, Plan, Point
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample, Scenario
from controlplane.deployments.models import Deployment
from controlplane.policy.services import update_policy
from loadgen.report import Row
from loadgen.stats import RequestRecord, summarize

pytestmark = pytest.mark.django_db(transaction=True)


def records(count: int, tpot_ms: float = 12.0) -> list[RequestRecord]:
    return [
        RequestRecord(
            index=i,
            prompt_tokens=128,
            max_tokens=16,
            sent_at=100.0 + i * 0.01,
            chunk_times=[100.0 + i * 0.01 + 0.09 + tpot_ms / 1000 * k for k in range(16)],
            ok=True,
        )
        for i in range(count)
    ]


def snapshot(run_id: int) -> dict[str, Any]:
    run = BenchmarkRun.objects.get(pk=run_id)
    return {
        "state": run.state,
        "phase": run.phase,
        "points": (run.points_done, run.points_total),
        "rows": [(r["mode"], r["concurrency"]) for r in run.summary.get("rows", [])],
        "partial": run.summary.get("partial", False),
        "samples": BenchmarkSample.objects.filter(run_id=run_id).count(),
        "eta": run.eta_at is not None,
        "versions": run.recorded_under.get("policy", {}).get("versions_seen"),
    }


def fake_measure(run_id: int, seen: list[dict[str, Any]], *, cancel_after: int = 0, on_point=None):
    """Measures every (level, mode) point instantly, as ``measure.measure`` reports them;
    after point ``cancel_after`` an operator presses Cancel, which the next report reads."""

    async def measure(plan: Plan, hooks: Hooks, sweeps: Any = None) -> list[Row]:
        rows: list[Row] = []
        index = 0
        for level in plan.levels:
            for target in plan.targets():
                index += 1
                point = Point(target.mode, level, None, index, plan.points_total, plan.warmup)
                await hooks.started(point)
                seen.append({"started": point.label, **await sync_to_async(snapshot)(run_id)})
                found = records(plan.iterations)
                row = Row(
                    target.mode,
                    level,
                    target.url,
                    "m",
                    summarize(found, 1.0),
                    found,
                    window=(0.0, 1.0),
                )
                rows.append(row)
                await hooks.finished(row)
                seen.append(await sync_to_async(snapshot)(run_id))
                if on_point is not None:
                    await sync_to_async(on_point)(index)
                if index == cancel_after:
                    await sync_to_async(
                        lambda: services.request_cancel(
                            BenchmarkRun.objects.get(pk=run_id), acting_user=None
                        )
                    )()
                if not await hooks.report(index, plan.points_total):
                    raise Cancelled()
        return rows

    return measure


@pytest.fixture
def run_of(make_deployment):
    def make(**fields: Any) -> BenchmarkRun:
        deployment = fields.pop("deployment", None) or make_deployment()
        # A transactional test flushes the seeded scenarios: make the short one again.
        short, _ = Scenario.objects.get_or_create(
            name="short", defaults={"input_tokens": 128, "output_tokens": 256}
        )
        return BenchmarkRun.objects.create(
            scenario=short,
            deployment=deployment,
            target_url="http://127.0.0.1:9/",
            **{"mode": "all", "concurrency": [1, 2, 4, 8], "iterations": 4, **fields},
        )

    return make


def test_points_are_stored_as_they_finish_with_phase_and_eta(run_of) -> None:
    run = run_of(mode="gpu", warmup=1)
    seen: list[dict[str, Any]] = []
    assert runner.execute(run.pk, measure_with=fake_measure(run.pk, seen)) == "succeeded"
    started = [s for s in seen if "started" in s]
    finished = [s for s in seen if "started" not in s]
    assert started[1]["phase"] == "warm-up, gpu c=2 (2 of 4 points)"
    assert started[1]["state"] == "running" and started[1]["points"] == (1, 4)
    # Each point's samples and its row are stored when it finishes, not at the end.
    assert [s["samples"] for s in finished] == [4, 8, 12, 16]
    assert [len(s["rows"]) for s in finished] == [1, 2, 3, 4]
    assert all(s["partial"] and s["eta"] for s in finished)
    assert finished[2]["points"] == (3, 4) and finished[2]["phase"] == "3 of 4 points measured"
    run.refresh_from_db()
    assert run.status == "succeeded" and not run.partial and run.eta_at is None
    assert (run.points_done, run.points_total) == (4, 4)
    assert "partial" not in run.summary and len(run.summary["rows"]) == 4
    assert BenchmarkSample.objects.filter(run=run).count() == 16


def test_a_benchmark_cancelled_half_way_keeps_its_finished_points(run_of, client) -> None:
    run = run_of(mode="all", concurrency=[1, 2, 4, 8])  # 12 points: 4 levels x 3 modes
    seen: list[dict[str, Any]] = []
    measure = fake_measure(run.pk, seen, cancel_after=6)
    assert runner.execute(run.pk, measure_with=measure) == "cancelled"
    run.refresh_from_db()
    assert run.status == "cancelled" and run.state == "cancelled" and not run.cancellable
    assert run.phase == "cancelled after 6 of 12 points" and run.partial
    assert run.summary["partial"] and len(run.summary["rows"]) == 6
    assert BenchmarkSample.objects.filter(run=run).count() == 6 * 4
    # The advisor may use the finished points, and says the run is partial.
    summaries = services.advisor_summaries()
    assert summaries[-1]["run"]["partial"] is True
    advice = analysis.advise(summaries, "throughput")
    assert advice.mode is not None
    assert any("partial (cancelled after 6 of 12 points)" in c for c in advice.caveats)


def test_a_cancel_that_arrives_with_the_last_point_leaves_one_state(run_of) -> None:
    run = run_of(mode="gpu", concurrency=[1, 2])
    seen: list[dict[str, Any]] = []
    # Cancel pressed as the last point finishes: the run is done, and it says so.
    assert runner.execute(run.pk, measure_with=fake_measure(run.pk, seen, cancel_after=2)) in (
        "succeeded",
        "cancelled",
    )
    run.refresh_from_db()
    assert run.state == run.status  # never "cancelling" once the run has ended
    assert not run.cancellable
    if run.status == "cancelled":
        assert run.phase == "cancelled after 2 of 2 points"
    # A cancel after the end changes nothing.
    after = services.request_cancel(run, acting_user=None)
    assert after.status == run.status and after.state == run.status


def test_a_queued_cancel_and_a_running_cancel_read_the_same_everywhere(run_of) -> None:
    queued = run_of()
    cancelled = services.request_cancel(queued, acting_user=None)
    assert (cancelled.status, cancelled.state, cancelled.cancellable) == (
        "cancelled",
        "cancelled",
        False,
    )
    assert runner.execute(queued.pk) == "cancelled"  # the task finds it cancelled: nothing runs
    running = run_of()
    BenchmarkRun.objects.filter(pk=running.pk).update(status="running")
    running.refresh_from_db()
    assert running.cancellable
    after = services.request_cancel(running, acting_user=None)
    assert (after.status, after.state, after.cancellable) == ("running", "cancelling", False)
    assert "cancelling" in services.cancel_message(after)


def test_a_run_names_its_policy_revision_and_a_change_while_it_ran(run_of) -> None:
    run = run_of(mode="hetero", concurrency=[1, 2, 4])
    deployment = Deployment.objects.select_related("policy", "profile").get(pk=run.deployment_id)
    policy = deployment.policy
    version = policy.version

    def change_policy(index: int) -> None:
        if index == 1:  # an operator edits the policy after the first point
            update_policy(policy, changes={"cpu_max_batch_size": 4}, acting_user=None, reason="x")

    seen: list[dict[str, Any]] = []
    runner.execute(run.pk, measure_with=fake_measure(run.pk, seen, on_point=change_policy))
    run.refresh_from_db()
    under = run.recorded_under
    assert under["policy"] == {
        "name": policy.name,
        "version": version,
        "versions_seen": [version, version + 1],
    }
    assert under["profile"]["name"] == deployment.profile.name
    assert len(under["profile"]["fingerprint"]) == 12 and under["profile"]["updated_at"]
    assert under["engines"]["kind"] == deployment.profile.engine
    assert run.summary["config"]["recorded_under"]["policy"]["versions_seen"][-1] == version + 1
    assert runner.profile_fingerprint(deployment.profile) == under["profile"]["fingerprint"]


def test_the_advisor_says_when_modes_ran_under_different_policy_revisions() -> None:
    def measured(run: int, mode: str, tput: float, version: int) -> dict:
        return {
            "config": {"recorded_under": {"policy": {"name": "default", "version": version}}},
            "run": {"id": run, "partial": False},
            "rows": [
                {"mode": mode, "concurrency": 4, "summary": {"output_throughput": tput}},
                {"mode": mode, "concurrency": 8, "summary": {"output_throughput": tput * 2}},
            ],
        }

    # GPU measured under v3 at 4 and 8; hetero (68 tok/s at 4) after a policy change, v5,
    # at 4 only: the modes compare at the level both measured, and the change is named.
    summaries = [measured(1, "gpu", 297.0, 3), measured(2, "hetero", 68.0, 5)]
    summaries[1]["rows"].pop()
    advice = analysis.advise(summaries, "throughput")
    assert advice.mode == "gpu"
    assert advice.figures["gpu"]["concurrency"] == 4.0  # not GPU at 8 against hetero at 4
    assert any(
        "different policy revisions (gpu under default v3 (run #1), hetero under default v5 "
        "(run #2))" in c
        for c in advice.caveats
    )
    # The page's footnote never contradicts the advice: it says the measurements differ.
    assert "sysHAX's guidance says hetero mode" in advice.guidance
    assert "these measurements say gpu mode" in advice.guidance
    same = analysis.advise(
        [measured(1, "gpu", 297.0, 3), measured(2, "hetero", 400.0, 3)], "throughput"
    )
    assert same.mode == "hetero" and same.caveats == []
    assert same.guidance.startswith("This agrees with sysHAX's guidance")


def test_the_admin_action_and_schedules_use_the_dashboard_defaults(
    make_deployment, admin_user
) -> None:
    deployment = make_deployment()
    Scenario.objects.get_or_create(name="short", defaults={"input_tokens": 1, "output_tokens": 1})
    request = RequestFactory().post("/")
    request.user = admin_user
    request._messages = type("M", (), {"add": lambda *a, **k: None})()  # type: ignore[attr-defined]
    run_benchmark(site._registry[Deployment], request, Deployment.objects.filter(pk=deployment.pk))
    run = BenchmarkRun.objects.get(deployment=deployment)
    assert run.concurrency == list(DEFAULT_CONCURRENCY) and run.iterations == DEFAULT_ITERATIONS
    task = schedules.create_schedule("nightly", deployment=deployment)
    spec = schedules.parse_kwargs(json.loads(task.kwargs))
    assert spec.iterations == DEFAULT_ITERATIONS
    bare = schedules.parse_kwargs({"deployment": deployment.name})
    assert bare.concurrency == list(DEFAULT_CONCURRENCY) and bare.iterations == DEFAULT_ITERATIONS
    assert BenchmarkRun().iterations == DEFAULT_ITERATIONS  # the model's (the API's) default


def test_schedule_problems_are_found_all_at_once(db) -> None:
    form = schedules.ScheduleForm(
        name="",
        kwargs={"deployment": "nope", "scenario": "huge", "iterations": 0, "mode": "x"},
        kind="crontab",
        crontab="61 2 * *",
    )
    problems = schedules.schedule_problems(form)
    assert set(problems) == {"name", "deployment", "scenario", "iterations", "mode", "crontab"}
    assert PeriodicTask.objects.count() == 0
