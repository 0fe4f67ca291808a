"""A benchmark run's page as the run goes: the progress JSON, the one state behind banner,
badge and Cancel, the policy revision beside the results, and the schedule form."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.urls import reverse
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from controlplane.benchmarks.models import BenchmarkRun
from controlplane.dashboard import benchdata
from tests.dashboard.conftest import finish_with_measurements

UNDER = {
    "policy": {"name": "default", "version": 7, "versions_seen": [7, 8]},
    "profile": {
        "name": "qwen32b",
        "fingerprint": "0123456789ab",
        "updated_at": "2026-01-02T03:04:05",
    },
    "engines": {"kind": "simulator", "sim_devices": ["a100-80gb", "kunpeng-920-7280z"]},
}


def running_run(scenario: Any, **fields: Any) -> BenchmarkRun:
    return BenchmarkRun.objects.create(
        scenario=scenario,
        target_url="http://127.0.0.1:9/",
        mode="all",
        concurrency=[1, 4],
        status="running",
        **fields,
    )


def test_the_progress_json_names_phase_points_and_eta(operator_client, scenario) -> None:
    run = running_run(
        scenario,
        progress=0.25,
        phase="warm-up, gpu c=4 (2 of 6 points)",
        points_done=1,
        points_total=6,
        eta_at=timezone.now() + timedelta(seconds=100),
    )
    body = operator_client.get(reverse("dashboard:benchmark-progress", args=[run.pk])).json()
    assert body["state"] == "running" and body["active"] and body["cancellable"]
    assert body["phase"] == "warm-up, gpu c=4 (2 of 6 points)"
    assert (body["points_done"], body["points_total"]) == (1, 6)
    assert 90 < body["eta_seconds"] <= 100 and body["eta"] == "about 2 min"
    assert body["banner"] == (
        f"Run {run.pk} is running: warm-up, gpu c=4 (2 of 6 points); about 2 min left."
    )
    assert body["percent"] == "25.0%"


def test_cancel_answers_the_new_state_and_the_page_agrees(operator_client, scenario) -> None:
    run = running_run(scenario, points_done=2, points_total=6)
    url = reverse("dashboard:benchmark-cancel", args=[run.pk])
    body = operator_client.post(url, HTTP_ACCEPT="application/json").json()
    assert body["state"] == "cancelling" and body["active"] and not body["cancellable"]
    assert "cancelling" in body["banner"] and "2 of 6 points finished" in body["banner"]
    page = operator_client.get(reverse("dashboard:benchmark", args=[run.pk])).content.decode()
    assert 'class="badge state-cancelling"' in page
    assert 'data-field="cancel" hidden' in page  # the Cancel button is gone
    assert "is running" not in page  # no banner that contradicts the badge
    # The runner stops it and keeps its points: the page says so, and charts them.
    finish_with_measurements(run)
    BenchmarkRun.objects.filter(pk=run.pk).update(
        status="cancelled", phase="cancelled after 2 of 6 points", summary={
            **BenchmarkRun.objects.get(pk=run.pk).summary, "partial": True
        }
    )  # fmt: skip
    body = operator_client.get(reverse("dashboard:benchmark-progress", args=[run.pk])).json()
    assert body["state"] == "cancelled" and not body["active"] and body["partial"]
    assert body["banner"] == f"Run {run.pk} was cancelled after 2 of 6 points."
    page = operator_client.get(reverse("dashboard:benchmark", args=[run.pk])).content.decode()
    assert "No data yet" not in page and "stored no measurements" not in page
    assert "Partial: cancelled after 2 of 6 points" in page and "svg" in page
    # A plain form (no script) gets the page again, with no flash message to go stale.
    other = running_run(scenario)
    answer = operator_client.post(reverse("dashboard:benchmark-cancel", args=[other.pk]))
    assert answer.status_code == 302


def test_a_run_that_names_its_policy_revision(operator_client, scenario) -> None:
    run = running_run(scenario, recorded_under=UNDER)
    finish_with_measurements(run)
    page = operator_client.get(reverse("dashboard:benchmark", args=[run.pk])).content.decode()
    assert "default v7 (changed while it ran: v7, v8)" in page
    assert "qwen32b · fingerprint 0123456789ab · updated 2026-01-02 03:04:05" in page
    assert "simulator · a100-80gb + kunpeng-920-7280z" in page
    older = running_run(scenario, recorded_under={"policy": {"name": "default", "version": 5}})
    finish_with_measurements(older)
    compare = operator_client.get(
        reverse("dashboard:benchmark-compare"), {"run": [run.pk, older.pk]}
    ).content.decode()
    assert "different policy revisions (default v5, default v7)" in compare
    assert compare.count("<dt>Policy</dt>") == 2


def test_the_banner_follows_the_one_state() -> None:
    assert benchdata.run_banner(3, "queued", "", 0, 0, None).startswith("Run 3 is queued")
    assert "the ETA follows the first finished point" in benchdata.run_banner(
        3, "running", "gpu c=1 (1 of 4 points)", 0, 4, None
    )
    assert benchdata.run_banner(3, "cancelled", "", 0, 4, None) == (
        "Run 3 was cancelled before it measured a point."
    )
    assert benchdata.run_banner(3, "succeeded", "", 4, 4, None) == (
        "Run 3 finished: 4 points measured."
    )
    assert benchdata.eta_text(125) == "about 2 min" and benchdata.eta_text(None) == ""


def test_the_schedule_form_creates_and_edits_a_periodic_task(
    admin_client, make_deployment, scenario
) -> None:
    deployment = make_deployment()
    url = reverse("dashboard:schedule-create")
    page = admin_client.get(url).content.decode()
    assert 'value="1,2,4,8"' in page and 'value="8"' in page  # the run form's defaults
    bad = admin_client.post(
        url,
        {
            "name": "",
            "deployment": "",
            "scenario": "short",
            "mode": "all",
            "concurrency": "0",
            "iterations": "0",
            "threshold_percent": "5",
            "kind": "crontab",
            "crontab": "61 2 * *",
        },
    )
    assert bad.status_code == 400
    html = bad.content.decode()
    assert "fix 5 problems" in html.lower()
    for message in (
        "give the schedule a name",
        "choose the deployment to benchmark",
        "each level must be between",
        "must be an integer between 1 and 100000",
        "give five fields",
    ):
        assert message in html, message
    assert not PeriodicTask.objects.filter(task="benchmarks.scheduled_run").exists()
    good = {
        "name": "nightly-hetero",
        "deployment": deployment.name,
        "scenario": "short",
        "mode": "hetero",
        "concurrency": "1,2,4,8",
        "iterations": "8",
        "threshold_percent": "10",
        "kind": "crontab",
        "crontab": "0 2 * * *",
        "enabled": "on",
    }
    assert admin_client.post(url, good).status_code == 302
    task = PeriodicTask.objects.get(name="nightly-hetero")
    assert task.task == "benchmarks.scheduled_run" and task.enabled
    assert str(task.crontab.hour) == "2" and task.interval is None
    assert json.loads(task.kwargs) == {
        "deployment": deployment.name,
        "scenario": "short",
        "mode": "hetero",
        "concurrency": [1, 2, 4, 8],
        "iterations": 8,
        "threshold_percent": 10.0,
    }
    # Edit it to every 6 hours, disabled.
    edit = reverse("dashboard:schedule-edit", args=[task.pk])
    assert 'value="0 2 * * *"' in admin_client.get(edit).content.decode()
    changed = {**good, "kind": "interval", "every": "6", "period": "hours"}
    del changed["enabled"]
    assert admin_client.post(edit, changed).status_code == 302
    task.refresh_from_db()
    assert not task.enabled and task.crontab is None
    assert (task.interval.every, task.interval.period) == (6, "hours")
    listing = admin_client.get(reverse("dashboard:benchmarks")).content.decode()
    assert edit in listing and "disabled" in listing
    # A taken name is refused beside the field.
    again = admin_client.post(url, good)
    assert again.status_code == 400 and "exists already" in again.content.decode()


def test_the_schedule_form_needs_its_permission(operator_client) -> None:
    assert operator_client.get(reverse("dashboard:schedule-create")).status_code == 403
