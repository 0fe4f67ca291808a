"""Every dashboard page through Django's test client: sign-in, content, forms and actions."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from controlplane.access.models import MachineCredential
from controlplane.benchmarks.models import BenchmarkRun
from controlplane.deployments.models import Deployment, DeploymentEvent
from controlplane.deployments.placement import check_placement
from controlplane.inventory.models import Heartbeat
from controlplane.policy.models import SchedulingPolicy
from controlplane.policy.services import ensure_default_policy, update_policy
from controlplane.routers.models import RouterInstance
from tests.dashboard.conftest import seed_finished_run

pytestmark = pytest.mark.django_db


def page_urls(node, deployment, run) -> list[str]:
    return [
        reverse("dashboard:overview"),
        reverse("dashboard:accelerators-json"),
        reverse("dashboard:nodes"),
        reverse("dashboard:node", args=[node.name]),
        reverse("dashboard:deployments"),
        reverse("dashboard:deployment", args=[deployment.pk]),
        reverse("dashboard:deployment-timeline", args=[deployment.pk]),
        reverse("dashboard:policies"),
        reverse("dashboard:policy", args=["default"]),
        reverse("dashboard:benchmarks"),
        reverse("dashboard:benchmark", args=[run.pk]),
        reverse("dashboard:benchmark-charts", args=[run.pk]),
        reverse("dashboard:benchmark-progress", args=[run.pk]),
        reverse("dashboard:benchmark-compare") + f"?run={run.pk}",
    ]


def test_every_page_needs_a_sign_in(make_deployment, finished_run) -> None:
    deployment = make_deployment()
    for url in page_urls(deployment.node, deployment, finished_run):
        response = Client().get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/accounts/login/"), url


def test_every_page_renders_for_a_signed_in_viewer(
    viewer_client: Client, make_deployment, finished_run
) -> None:
    deployment = make_deployment()
    for url in page_urls(deployment.node, deployment, finished_run):
        response = viewer_client.get(url, follow=True)
        assert response.status_code == 200, url


def test_login_page_signs_in_and_returns_to_next(operator) -> None:
    client = Client()
    page = client.get("/accounts/login/?next=/nodes/")
    assert b'name="username"' in page.content and b"csrfmiddlewaretoken" in page.content
    response = client.post(
        "/accounts/login/",
        {"username": "operator", "password": "dashboard-test-pass-1", "next": "/nodes/"},
    )
    assert response.status_code == 302 and response["Location"] == "/nodes/"
    bad = Client().post("/accounts/login/", {"username": "operator", "password": "wrong"})
    assert bad.status_code == 200 and b'role="alert"' in bad.content


def test_overview_shows_fleet_and_attention(operator_client: Client, make_node, make_deployment):
    lost = make_node("lost-node", status="offline")
    broken = make_deployment(name="broken-dep", state="failed", state_reason="CPU engine exited")
    credential, _ = MachineCredential.issue("router", "router-a")
    RouterInstance.objects.create(
        name="router-a",
        credential=credential,
        request_rate=2.5,
        policy_version=3,
        stats={"decisions": {"gpu-only": 30, "pd": 60, "cpu-only": 10}},
    )
    html = operator_client.get("/").content.decode()
    assert "node lost-node is offline" in html
    assert f"deployment {broken.name} is failed: CPU engine exited" in html
    assert "simulated" in html  # the fixture's A100 is declared simulated
    assert "router-a" in html and "pd 60 (60%)" in html
    assert reverse("dashboard:node", args=[lost.name]) in html


def test_accelerator_readings_are_live_json(operator_client: Client, make_node) -> None:
    node = make_node()
    data = operator_client.get(reverse("dashboard:accelerators-json")).json()
    (reading,) = data["accelerators"]
    assert reading["utilization_percent"] == 37.5
    assert reading["memory_total_gb"] == 80.0 and reading["memory_percent"] == 25.0
    node.accelerators.update(utilization_percent=91.0)
    again = operator_client.get(reverse("dashboard:accelerators-json")).json()
    assert again["accelerators"][0]["utilization_percent"] == 91.0


def test_node_page_draws_topology_with_engine_cores(operator_client, make_node, make_deployment):
    node = make_node("kunpeng", sockets=2, numa=4, cores_per_numa=8)
    make_deployment(
        name="hetero-a",
        node=node,
        state="running",
        affinity_plan={"cpuset": "8-15,16-23", "gpu_cpuset": "0-1"},
    )
    Heartbeat.objects.create(node=node, cpu_percent=42.0, memory_total_bytes=1)
    Heartbeat.objects.create(node=node, cpu_percent=55.0, memory_total_bytes=1)
    html = operator_client.get(reverse("dashboard:node", args=["kunpeng"])).content.decode()
    assert html.count('class="socket"') == 2
    assert html.count('class="numa"') == 4
    assert html.count('<li class="core') == 32
    assert html.count('class="core h0"') == 16  # the CPU engine's 16 cores
    assert html.count('class="core h1"') == 2  # the GPU engine's host threads
    assert "hetero-a CPU engine" in html and "CPUs 8-15,16-23 (16 on this node)" in html
    assert "simulated" in html
    assert "55.0%" in html and "<svg" in html  # heartbeat history and its sparkline


def test_a_node_that_never_reported_its_hardware(operator_client) -> None:
    from controlplane.inventory.models import Node

    Node.objects.create(name="fresh")
    html = operator_client.get(reverse("dashboard:node", args=["fresh"])).content.decode()
    assert "has not reported this node's CPU topology yet" in html
    assert "No heartbeats recorded" in html
    assert operator_client.get(reverse("dashboard:nodes")).status_code == 200


def test_unknown_node_and_deployment_are_friendly_404s(operator_client: Client) -> None:
    for url in ("/nodes/nope/", "/deployments/999999/", "/benchmarks/999999/", "/nowhere/"):
        response = operator_client.get(url)
        assert response.status_code == 404
        assert b"Page not found" in response.content
        assert b"Traceback" not in response.content and b"DEBUG" not in response.content


def test_create_deployment_calls_the_service_and_deploys(operator_client, make_node, make_profile):
    node, profile = make_node("gpu-box"), make_profile()
    response = operator_client.post(
        reverse("dashboard:deployment-create"),
        {"name": "qwen-hetero", "profile": profile.pk, "node": node.name, "start": "on"},
    )
    deployment = Deployment.objects.get(name="qwen-hetero")
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:deployment", args=[deployment.pk])
    # create_deployment(start=True) went through request_deploy: a generation and its events.
    assert deployment.state == "deploying" and deployment.generation == 1
    steps = list(
        DeploymentEvent.objects.filter(deployment=deployment).values_list("step", flat=True)
    )
    assert steps[:2] == ["created", "deploy"]
    assert deployment.created_by is not None and deployment.created_by.username == "operator"


def test_a_deployment_without_a_node_is_placed_on_a_labelled_node(
    operator_client, make_node, make_profile
) -> None:
    make_node("rack1-box", status="online", labels={"rack": "r1"})
    wanted = make_node("rack2-box", status="online", labels={"rack": "r2"})
    response = operator_client.post(
        reverse("dashboard:deployment-create"),
        {"name": "placed", "profile": make_profile().pk, "node": "", "node_selector": "rack=r2"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    deployment = Deployment.objects.get(name="placed")
    assert (deployment.node, deployment.pinned, deployment.node_selector) == (
        wanted,
        False,
        {"rack": "r2"},
    )
    refused = operator_client.post(
        reverse("dashboard:deployment-create"),
        {"name": "nowhere", "profile": make_profile().pk, "node_selector": "rack"},
    )
    assert refused.status_code == 400
    assert "write labels as name=value" in refused.content.decode()


def test_placement_errors_are_shown_inline(operator_client, make_node, make_profile) -> None:
    node = make_node("small-box", accelerators=1, accel_gb=16)
    profile = make_profile(tensor_parallel_size=2)
    response = operator_client.post(
        reverse("dashboard:deployment-create"),
        {"name": "too-big", "profile": profile.pk, "node": node.name},
    )
    html = response.content.decode()
    assert response.status_code == 400
    # Every reason placement gives is shown, in the placement module's own words.
    problems = check_placement(profile, node)
    assert problems and problems[0].field == "tensor_parallel_size"
    for problem in problems:
        assert escape(f"{problem.field}: {problem.message}") in html
    assert 'class="field invalid"' in html
    assert not Deployment.objects.filter(name="too-big").exists()


def test_form_validation_errors_are_shown_inline(operator_client, make_deployment) -> None:
    existing = make_deployment(name="taken")
    response = operator_client.post(
        reverse("dashboard:deployment-create"),
        {"name": "taken", "profile": existing.profile.pk, "node": "no-such-node"},
    )
    html = response.content.decode()
    assert response.status_code == 400
    assert "a deployment named &#x27;taken&#x27; already exists" in html
    assert "Select a valid choice" in html


@pytest.mark.parametrize(
    ("action", "state", "step"),
    [
        ("deploy", "deploying", "deploy"),
        ("stop", "stopping", "stop"),
        ("restart", "deploying", "deploy"),
    ],
)
def test_deployment_buttons_call_the_services(
    operator_client, make_deployment, action, state, step
) -> None:
    deployment = make_deployment(state="running", desired_state="running", generation=1)
    url = reverse("dashboard:deployment-action", args=[deployment.pk, action])
    assert operator_client.get(url).status_code == 405  # buttons are POST forms
    response = operator_client.post(url)
    assert response.status_code == 302
    deployment.refresh_from_db()
    assert deployment.state == state
    assert DeploymentEvent.objects.filter(
        deployment=deployment, step=action if action != "restart" else "deploy"
    ).exists()


def test_actions_need_permission_and_csrf(viewer_client, operator, make_deployment) -> None:
    deployment = make_deployment()
    assert viewer_client.get(reverse("dashboard:deployment-create")).status_code == 403
    url = reverse("dashboard:deployment-action", args=[deployment.pk, "deploy"])
    refused = viewer_client.post(url)
    assert refused.status_code == 403 and b"Not allowed" in refused.content
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(operator)
    assert strict.post(url).status_code == 403
    deployment.refresh_from_db()
    assert deployment.state == "pending"


def test_timeline_json_returns_events_after_an_id(operator_client, make_deployment) -> None:
    from controlplane.deployments.services import request_deploy

    deployment = make_deployment()
    deployment = request_deploy(deployment, acting_user="test")
    url = reverse("dashboard:deployment-timeline", args=[deployment.pk])
    data = operator_client.get(url).json()
    assert data["state"] == "deploying" and data["generation"] == 1
    first = data["events"][0]["id"]
    later = operator_client.get(url, {"after": first}).json()
    assert all(e["id"] > first for e in later["events"])
    assert len(later["events"]) == len(data["events"]) - 1


def test_policy_page_shows_every_knob_with_its_meaning(operator_client) -> None:
    from common.policy_schema import KNOBS

    html = operator_client.get(reverse("dashboard:policy", args=["default"])).content.decode()
    for knob in KNOBS:
        assert f'name="{knob.name}"' in html
        assert knob.meaning.replace("'", "&#x27;") in html


def _policy_post(policy: SchedulingPolicy, **changes) -> dict:
    data = {k: v for k, v in policy.knobs().items() if v is not False}
    data.update(changes)
    return data


def test_policy_save_needs_a_reason_and_records_a_revision(operator_client) -> None:
    policy = ensure_default_policy()
    url = reverse("dashboard:policy", args=["default"])
    missing = operator_client.post(url, _policy_post(policy, cpu_max_batch_size=12))
    assert missing.status_code == 400 and b"This field is required" in missing.content
    response = operator_client.post(
        url, _policy_post(policy, cpu_max_batch_size=12, reason="more CPU decode slots")
    )
    assert response.status_code == 302
    policy.refresh_from_db()
    assert policy.version == 2 and policy.cpu_max_batch_size == 12
    revision = policy.revisions.get(version=2)
    assert revision.changed == {"cpu_max_batch_size": [8, 12]}
    assert revision.reason == "more CPU decode slots"
    html = operator_client.get(url).content.decode()
    assert "<del>8</del>" in html and "<ins>12</ins>" in html


def test_policy_errors_from_the_schema_are_shown_beside_the_knob(operator_client) -> None:
    policy = ensure_default_policy()
    url = reverse("dashboard:policy", args=["default"])
    response = operator_client.post(
        url, _policy_post(policy, token_limit_min=500, token_limit_max=100, reason="try")
    )
    html = response.content.decode()
    assert response.status_code == 400
    assert "must not exceed token_limit_max (500 &gt; 100)" in html
    unchanged = operator_client.post(url, _policy_post(policy, reason="no-op"))
    assert b"every knob to its current value" in unchanged.content
    policy.refresh_from_db()
    assert policy.version == 1


def test_policy_rollback_restores_an_earlier_revision(operator_client) -> None:
    policy = ensure_default_policy()
    update_policy(policy, changes={"mode": "gpu-only"}, acting_user="test", reason="pin gpu")
    response = operator_client.post(
        reverse("dashboard:policy-rollback", args=["default"]), {"version": "1", "reason": ""}
    )
    assert response.status_code == 302
    policy.refresh_from_db()
    assert policy.mode == "auto" and policy.version == 3
    assert policy.revisions.get(version=3).rolled_back_to == 1


def test_policy_change_needs_permission(viewer_client) -> None:
    policy = ensure_default_policy()
    url = reverse("dashboard:policy", args=["default"])
    assert (
        viewer_client.post(url, _policy_post(policy, reason="x", mode="cpu-only")).status_code
        == 403
    )
    rollback = reverse("dashboard:policy-rollback", args=["default"])
    assert viewer_client.post(rollback, {"version": "1"}).status_code == 403


def test_start_a_benchmark_run_through_the_service(operator_client, scenario) -> None:
    response = operator_client.post(
        reverse("dashboard:benchmark-create"),
        {
            "scenario": "short",
            "target_url": "http://127.0.0.1:9/",
            "mode": "hetero",
            "concurrency": "1-4",
            "iterations": "3",
            "warmup": "0",
        },
    )
    run = BenchmarkRun.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:benchmark", args=[run.pk])
    assert run.concurrency == [1, 2, 3, 4] and run.created_by.username == "operator"


def test_start_a_goodput_sweep_from_the_form(operator_client, scenario) -> None:
    form = {
        "scenario": "short",
        "target_url": "http://127.0.0.1:9/",
        "mode": "all",
        "concurrency": "1",
        "iterations": "3",
        "warmup": "0",
        "request_rates": "1, 2,4",
    }
    no_slo = operator_client.post(reverse("dashboard:benchmark-create"), form)
    assert no_slo.status_code == 400
    assert b"a goodput sweep needs an SLO TTFT or TPOT" in no_slo.content
    unsorted = operator_client.post(
        reverse("dashboard:benchmark-create"), {**form, "request_rates": "4,2", "slo_tpot_ms": "50"}
    )
    assert unsorted.status_code == 400 and b"strictly ascending" in unsorted.content
    assert not BenchmarkRun.objects.exists()
    done = operator_client.post(
        reverse("dashboard:benchmark-create"),
        {**form, "slo_tpot_ms": "50", "find_max_goodput": "on"},
    )
    assert done.status_code == 302
    run = BenchmarkRun.objects.get()
    assert run.request_rates == [1.0, 2.0, 4.0] and run.slo_tpot_ms == 50.0
    assert run.find_max_goodput and run.slo_ttft_ms is None


def test_benchmark_form_errors_inline(operator_client, scenario) -> None:
    response = operator_client.post(
        reverse("dashboard:benchmark-create"),
        {
            "scenario": "short",
            "mode": "hetero",
            "concurrency": "0,5000",
            "iterations": "3",
            "warmup": "0",
        },
    )
    html = response.content.decode()
    assert response.status_code == 400
    assert "each level must be between 1 and 1024" in html
    nowhere = operator_client.post(
        reverse("dashboard:benchmark-create"),
        {"scenario": "short", "mode": "gpu", "concurrency": "2", "iterations": "3", "warmup": "0"},
    )
    assert nowhere.status_code == 400 and b"give a deployment or a target URL" in nowhere.content
    assert not BenchmarkRun.objects.exists()


def test_benchmark_page_charts_a_finished_run(operator_client, finished_run) -> None:
    url = reverse("dashboard:benchmark", args=[finished_run.pk])
    html = operator_client.get(url).content.decode()
    assert html.count("<svg") == 6  # throughput, TTFT, TPOT and one histogram per mode
    assert "Throughput against concurrency per mode" in html
    assert html.count("<polyline") == 3 and "stored summary" in html
    progress_url = reverse("dashboard:benchmark-progress", args=[finished_run.pk])
    progress = operator_client.get(progress_url).json()
    assert progress["status"] == "succeeded" and progress["progress"] == 1.0
    assert progress["active"] is False


def test_a_run_without_summary_is_charted_from_its_samples(operator_client, scenario) -> None:
    run = seed_finished_run(scenario, with_summary=False)
    html = operator_client.get(reverse("dashboard:benchmark", args=[run.pk])).content.decode()
    assert html.count("<svg") == 6 and "per-request samples" in html


def test_benchmark_page_degrades_without_data(operator_client, scenario) -> None:
    run = BenchmarkRun.objects.create(
        scenario=scenario, target_url="http://127.0.0.1:9/", status="failed"
    )
    html = operator_client.get(reverse("dashboard:benchmark", args=[run.pk])).content.decode()
    assert "<svg" not in html and "stored no measurements" in html


def test_compare_and_advisor(operator_client, scenario, finished_run) -> None:
    empty = operator_client.get(reverse("dashboard:benchmarks")).content.decode()
    assert "No scheduled benchmarks." in empty
    other = BenchmarkRun.objects.create(scenario=scenario, target_url="http://127.0.0.1:9/")
    html = operator_client.get(
        reverse("dashboard:benchmark-compare"), {"run": [finished_run.pk, other.pk]}
    ).content.decode()
    assert f"#{finished_run.pk} hetero" in html and "No measurements (queued)" in html
    # The benchmarks app's advisor decides from the stored summaries.
    assert "Recommended: <strong>hetero mode</strong> — highest output throughput" in empty
    latency = operator_client.get(reverse("dashboard:benchmarks"), {"goal": "latency"})
    assert "Recommended: <strong>gpu mode</strong>" in latency.content.decode()
    slo = operator_client.get(reverse("dashboard:benchmarks"), {"goal": "slo"})
    assert "the slo goal needs ttft_slo_ms or tpot_slo_ms" in slo.content.decode()


def test_scheduled_benchmarks_are_listed_with_admin_links(operator_client, scenario) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.DAYS)
    task = PeriodicTask.objects.create(
        name="nightly-short",
        task="benchmarks.scheduled_run",
        interval=every,
        kwargs='{"deployment": "qwen32b-hetero", "scenario": "short"}',
        enabled=False,
        description="disabled: no deployment named 'qwen32b-hetero'",
    )
    html = operator_client.get(reverse("dashboard:benchmarks")).content.decode()
    assert reverse("dashboard:schedule-edit", args=[task.pk]) in html
    assert "nightly-short</a>: every day on qwen32b-hetero, short" in html
    assert "disabled" in html


def test_advisor_says_when_nothing_was_measured(operator_client, scenario) -> None:
    html = operator_client.get(reverse("dashboard:benchmarks")).content.decode()
    assert "No measured runs yet: run a benchmark in each mode" in html


def test_cancel_a_queued_run(operator_client, scenario) -> None:
    run = BenchmarkRun.objects.create(scenario=scenario, target_url="http://127.0.0.1:9/")
    response = operator_client.post(reverse("dashboard:benchmark-cancel", args=[run.pk]))
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == "cancelled" and run.cancel_requested


def test_server_error_page_leaks_nothing(rf) -> None:
    from django.views.defaults import server_error

    response = server_error(rf.get("/deployments/1/"))
    html = response.content.decode()
    assert response.status_code == 500 and "Something went wrong" in html
    assert "Traceback" not in html and "/deployments/1/" not in html
    assert "settings" not in html.lower()


def test_timeline_first_look_shows_the_latest_events(operator_client, make_deployment) -> None:
    from controlplane.deployments.services import add_event

    deployment = make_deployment()
    for number in range(205):
        add_event(deployment, "probe", f"event {number}")
    html = operator_client.get(reverse("dashboard:deployment", args=[deployment.pk])).content
    assert b"event 204" in html and b"event 4<" not in html


def test_the_dashboard_session_works_for_the_rest_api(operator, make_deployment) -> None:
    """Signed in once, the browser's session (with its CSRF token) drives the REST API too."""
    deployment = make_deployment()
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(operator)
    browser.get(reverse("dashboard:deployment", args=[deployment.pk]))
    token = browser.cookies["csrftoken"].value
    url = f"/api/v1/deployments/{deployment.pk}/deploy"
    assert browser.post(url).status_code == 403  # no CSRF token: refused
    answer = browser.post(url, HTTP_X_CSRFTOKEN=token)
    assert answer.status_code == 202 and answer.json()["state"] == "deploying"
    events = browser.get(f"/api/v1/deployments/{deployment.pk}/events").json()
    assert [e["step"] for e in events["results"]] == ["deploy"]
