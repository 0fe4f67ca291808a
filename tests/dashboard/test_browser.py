"""The dashboard in a real browser: Playwright drives Debian's Chromium against a live server.

The server is pytest-django's live server on the test database. Celery tasks run eagerly in
it (the worker itself is covered by tests/controlplane/test_celery_live.py), while commands
for the node still travel through the real broker queue to a stand-in agent that answers
through the REST API with an agent token.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from asgiref.sync import SyncToAsync
from django.contrib.auth.models import User
from django.db import connections

from controlplane.access.models import MachineCredential
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample
from controlplane.celery import app
from controlplane.deployments.models import Deployment
from controlplane.deployments.placement import check_placement
from controlplane.inventory.models import Node
from controlplane.policy.models import SchedulingPolicy
from controlplane.policy.services import ensure_default_policy
from controlplane.routers.models import RouterInstance
from controlplane.routers.services import record_stats
from loadgen.simproc import running_sim
from tests.dashboard.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    StandInAgent,
    ensure_browser,
    save_screenshot,
)
from tests.dashboard.conftest import PASSWORD, finish_with_measurements, seed_finished_run

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    # Commands go to the node's queue with send_task on purpose, eager mode or not.
    pytest.mark.filterwarnings("ignore::celery.exceptions.AlwaysEagerIgnored"),
]

GIB = 1024**3
EXPECTED_4XX = (
    "/no/such/page/",
    "/deployments/new/",
    "/benchmarks/new/",
    "/profiles/new/",
    "/edit/",
)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    ensure_browser()
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread while it runs; Django's ORM
    # refuses to run beside one unless told that this thread really is synchronous.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield from _launch(sync_playwright)


def _launch(sync_playwright: Any) -> Iterator[Any]:
    with tempfile.TemporaryDirectory(prefix="syshax-chromium-") as profile:
        manager = sync_playwright().start()
        try:
            context = manager.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 900},
            )
            yield context
            context.close()
        finally:
            manager.stop()


@pytest.fixture
def eager_tasks() -> Iterator[None]:
    previous = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = previous
    # The benchmark runner reports progress through sync_to_async, whose one shared thread
    # keeps its own database connection; close it, or the test database cannot be dropped.
    SyncToAsync.single_thread_executor.submit(connections.close_all).result(timeout=30)


@pytest.fixture
def fleet(live_server: Any, make_node, make_profile, make_deployment, scenario) -> dict[str, Any]:
    """A small, plausible fleet: what an operator would see on a sysHAX-style server."""
    node = make_node("kunpeng-a100", sockets=2, numa=4, cores_per_numa=40)
    node.accelerators.update(utilization_percent=0.0, memory_used_bytes=0)
    make_node("cpu-box-2", accelerators=0, numa=2, cores_per_numa=8, status="offline")
    _credential, token = MachineCredential.issue("agent", "agent-kunpeng", node=node)
    with httpx.Client(
        base_url=live_server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as http:
        for cpu, util in ((22.0, 41.0), (35.5, 63.0), (48.0, 77.5)):
            answer = http.post(
                f"/api/v1/nodes/{node.pk}/heartbeat",
                json={
                    "cpu_percent": cpu,
                    "memory_used_bytes": 210 * GIB,
                    "memory_total_bytes": 512 * GIB,
                    "accelerators": [
                        {
                            "uuid": f"GPU-{node.name}-0",
                            "utilization_percent": util,
                            "memory_used_bytes": 64 * GIB,
                            "temperature_c": 61.0,
                        }
                    ],
                },
            )
            assert answer.status_code == 200, answer.text
    profile = make_profile(name="qwen32b-q4-hetero", served_model_name="qwen32b")
    make_deployment(
        name="qwen32b-hetero",
        node=node,
        profile=profile,
        state="running",
        desired_state="running",
        generation=1,
        gpu_endpoint="http://127.0.0.1:7001",
        cpu_endpoint="http://127.0.0.1:7002",
        affinity_plan={"cpuset": "8-39,48-79,88-119,128-159", "gpu_cpuset": "0-3"},
    )
    router_credential, _ = MachineCredential.issue("router", "router-a")
    router = RouterInstance.objects.create(name="router-a", credential=router_credential)
    record_stats(
        router,
        {
            "policy_version": 1,
            "request_rate": 6.4,
            "decisions": {"gpu-only": 118, "pd": 243, "cpu-only": 0, "rejected": 2},
        },
    )
    ensure_default_policy()
    run = seed_finished_run(scenario)
    return {"node": node, "token": token, "profile": profile, "run": run}


def sign_in(page: Any, base_url: str) -> None:
    User.objects.create_superuser("admin", "admin@example.com", PASSWORD)
    page.goto(f"{base_url}/")
    assert "/accounts/login/" in page.url
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base_url}/")


@pytest.fixture
def page(
    chromium: Any, live_server: Any, eager_tasks: None, fleet: dict[str, Any]
) -> Iterator[Any]:
    chromium.clear_cookies()
    tab = chromium.new_page()
    tab.set_default_timeout(15_000)
    problems: list[str] = []
    tab.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))

    def on_console(msg: Any) -> None:
        # A missing page and a form with errors answer 404/400 on purpose; the tests check them.
        url = msg.location.get("url", "")
        if msg.type == "error" and not url.endswith(EXPECTED_4XX):
            problems.append(f"console {msg.type}: {msg.text} at {msg.location}")

    tab.on("console", on_console)
    sign_in(tab, live_server.url)
    yield tab
    tab.close()
    assert problems == [], problems


def test_walk_every_page(page: Any, live_server: Any, fleet: dict[str, Any]) -> None:
    base = live_server.url
    html = page.content()
    assert "node cpu-box-2 is offline" in html
    assert page.locator(".badge.simulated").first.is_visible()
    assert "pd 243" in html
    save_screenshot(page, "overview", for_docs=True)

    page.click("nav >> text=Nodes")
    page.click("text=kunpeng-a100")
    assert page.locator("li.core").count() == 160
    assert page.locator("li.core.h0").count() == 128  # the CPU engine's cores
    assert page.locator("li.core.h1").count() == 4  # the GPU engine's host threads
    assert page.locator("figure.socket").count() == 2
    save_screenshot(page, "node", for_docs=True)

    walk_profiles(page, fleet)

    for label, heading in [
        ("Deployments", "Deployments"),
        ("Policy", "Policy default"),
        ("Benchmarks", "Benchmarks"),
    ]:
        page.click(f"nav >> text={label}")
        assert heading in page.locator("h1").inner_text()
    save_screenshot(page, "benchmarks")

    page.goto(f"{base}/benchmarks/{fleet['run'].pk}/")
    assert page.locator("svg.chart").count() == 6
    page.goto(f"{base}/benchmarks/compare/?run={fleet['run'].pk}")
    assert page.locator("svg.chart").count() == 1

    missing = page.goto(f"{base}/no/such/page/")
    assert missing is not None and missing.status == 404
    assert "Page not found" in page.content()

    # Narrow screen: the layout folds to one column and nothing overflows sideways.
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{base}/")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"page is {overflow}px wider than a phone screen"
    save_screenshot(page, "overview-narrow")
    page.set_viewport_size({"width": 1280, "height": 900})


def walk_profiles(page: Any, fleet: dict[str, Any]) -> None:
    """The profile list, a profile's page and its edit form, errors first, then a save."""
    profile = fleet["profile"]
    page.click("nav >> text=Profiles")
    assert page.locator("h1").inner_text() == "Profiles"
    assert page.locator("nav a[aria-current=page]").inner_text() == "Profiles"
    save_screenshot(page, "profiles", for_docs=True)

    page.click(f"table >> text={profile.name}")
    assert page.locator("h1").inner_text() == f"Profile {profile.name}"
    # Its own running deployment holds cores on kunpeng-a100: that is no reason not to fit.
    assert page.locator('tr[data-node="kunpeng-a100"]').get_attribute("data-fits") == "yes"
    assert page.locator('tr[data-node="cpu-box-2"]').get_attribute("data-fits") == "no"
    assert page.locator(".errors").count() == 0
    assert page.locator("#setting-tensor_parallel_size").inner_text() == "1"
    assert "docker run" in page.locator("#render-docker").inner_text()
    # The long command lines scroll inside their card, not the page.
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the profile page is {overflow}px wider than the window"
    save_screenshot(page, "profile", for_docs=True)

    page.click("text=Edit the settings")
    page.fill("#id_tensor_parallel_size", "0")
    page.fill("#id_gpu_memory_utilization", "1.5")
    page.fill("#id_cpu_env", "OMP_DISPLAY_ENV=true\nnot a variable")
    page.click("button:text('Save profile')")
    assert page.locator("#form-errors li").count() == 3
    assert page.locator(".field.invalid").count() == 3
    save_screenshot(page, "profile-edit", for_docs=True)

    page.fill("#id_tensor_parallel_size", "1")
    page.fill("#id_gpu_memory_utilization", "0.85")
    page.fill("#id_cpu_env", "OMP_DISPLAY_ENV=true")
    page.click("button:text('Save profile')")
    page.wait_for_selector(f"text=profile {profile.name} saved")
    assert page.locator("#setting-gpu_memory_utilization").inner_text() == "0.85"
    assert page.locator("#setting-cpu_env").inner_text() == "OMP_DISPLAY_ENV=true"


def test_create_a_deployment_and_watch_it_become_running(
    page: Any, live_server: Any, fleet: dict[str, Any], make_profile
) -> None:
    base = live_server.url
    node: Node = fleet["node"]
    # A profile that needs two cards on a one-card node: the placement error shows inline.
    too_big = make_profile(name="needs-two-cards", tensor_parallel_size=2)
    page.goto(f"{base}/deployments/")
    page.fill("#id_name", "qwen32b-two")
    page.select_option("#id_profile", str(too_big.pk))
    page.select_option("#id_node", node.name)
    page.click("text=Create deployment")
    error = page.locator(".field.invalid .field-error")
    (problem,) = check_placement(too_big, node)
    assert error.inner_text() == f"{problem.field}: {problem.message}"
    assert problem.field == "tensor_parallel_size"
    save_screenshot(page, "deployment-error")

    agent = StandInAgent(live_server.url, fleet["token"], delay=0.7)
    agent.start()
    try:
        # Its own ports: qwen32b-hetero already listens on 7001/7002 of this node.
        second = make_profile(
            name="qwen32b-q4-second", served_model_name="qwen32b", gpu_port=7101, cpu_port=7102
        )
        page.goto(f"{base}/deployments/")
        page.fill("#id_name", "qwen32b-second")
        page.select_option("#id_profile", str(second.pk))
        page.select_option("#id_node", node.name)
        page.uncheck("#id_start")
        page.click("text=Create deployment")
        page.wait_for_selector("text=deployment qwen32b-second created")
        assert page.locator('[data-field="state"]').inner_text() == "pending"
        page.evaluate("window.__sameDocument = true")
        before = page.locator(".timeline li").count()
        page.click("button:text('Deploy')")
        page.wait_for_selector("text=deploy requested for qwen32b-second")
        # From here on the page is never reloaded: the timeline fills in from the agent's results.
        page.evaluate("window.__sameDocument = true")
        page.wait_for_selector('[data-field="state"].state-running', timeout=60_000)
        assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
        steps = page.locator(".timeline li .step").all_inner_texts()
        for step in ("stop-old-cpu", "stop-old-gpu", "start-gpu", "start-cpu", "running"):
            assert any(text.endswith(step) for text in steps), (step, steps)
        assert page.locator(".timeline li").count() > before + 8
        assert page.locator(".timeline li.new").count() > 0  # appended live by the poller
        assert page.locator('[data-field="gpu-endpoint"]').inner_text() == "http://127.0.0.1:7101"
        save_screenshot(page, "deployment", for_docs=True)
    finally:
        agent.stop()
        agent.join(10)
    assert agent.errors == []
    # GPU first, then CPU, as sysHAX's deployment guide orders them.
    sequence = [(c["action"], c["role"]) for c in agent.handled]
    assert sequence == [("stop", "cpu"), ("stop", "gpu"), ("start", "gpu"), ("start", "cpu")]
    deployment = Deployment.objects.get(name="qwen32b-second")
    assert deployment.state == "running" and deployment.gpu_endpoint == "http://127.0.0.1:7101"


def test_change_the_policy(page: Any, live_server: Any) -> None:
    page.goto(f"{live_server.url}/policy/default/")
    assert "sysHAX enable_auto_pd_offload" in page.content()
    page.fill("#id_cpu_max_batch_size", "12")
    page.fill("#id_gpu_cache_threshold", "85")
    page.fill("#id_reason", "more CPU decode slots for the evening peak")
    page.click("button:text('Save as v2')")
    page.wait_for_selector("text=policy default saved as v2")
    revision = page.locator("#v2")
    assert "more CPU decode slots" in revision.inner_text()
    assert revision.locator("del").all_inner_texts() == ["90.0", "8"]
    assert revision.locator("ins").all_inner_texts() == ["85.0", "12"]
    save_screenshot(page, "policy", for_docs=True)
    page.fill("#rb-reason-1", "back to the defaults")
    page.click("button:text('Roll back to v1')")
    page.wait_for_selector("text=rolled back to v1 (now v3)")
    policy = SchedulingPolicy.objects.get(name="default")
    assert policy.version == 3 and policy.cpu_max_batch_size == 8


def test_start_a_benchmark_and_see_its_chart(
    page: Any, live_server: Any, fleet: dict[str, Any]
) -> None:
    """A run started from the form measures a simulated A100 engine (``syshax sim``, time
    compressed 20x) with the real runner and load generator, and the page charts it."""
    with running_sim("a100-80gb", speed=20.0) as engine:
        page.goto(f"{live_server.url}/benchmarks/")
        page.select_option("#id_scenario", "short")
        page.fill("#id_target_url", engine)
        page.select_option("#id_mode", "gpu")
        page.fill("#id_concurrency", "1,2")
        page.fill("#id_iterations", "4")
        with page.expect_navigation(timeout=120_000):
            page.click("button:text('Start run')")
    run = BenchmarkRun.objects.exclude(pk=fleet["run"].pk).get()
    assert f"/benchmarks/{run.pk}/" in page.url
    assert run.status == "succeeded", run.error
    assert run.samples.filter(ok=True).count() == 8
    assert page.locator('[data-field="status"]').inner_text() == "succeeded"
    throughput = page.locator("svg.chart").first
    assert throughput.locator("circle").count() == 2  # concurrency 1 and 2, gpu mode
    assert page.locator("svg.chart").count() == 4  # throughput, TTFT, TPOT, one histogram
    assert page.locator("table.figures tbody tr").count() == 2
    save_screenshot(page, "benchmark-measured")


def test_watch_a_run_progress_and_its_charts_appear(
    page: Any, live_server: Any, scenario: Any
) -> None:
    """While a run is active the page follows its progress; when it ends the charts are
    swapped in, without a reload. The test writes what the runner writes, step by step."""
    run = BenchmarkRun.objects.create(
        scenario=scenario,
        target_url="http://127.0.0.1:9/",
        mode="all",
        concurrency=[1, 4],
        status="running",
        progress=0.1,
    )
    page.goto(f"{live_server.url}/benchmarks/{run.pk}/")
    assert "No data yet" in page.content()
    page.evaluate("window.__sameDocument = true")
    BenchmarkRun.objects.filter(pk=run.pk).update(progress=0.55)
    page.wait_for_selector('[data-field="percent"]:text("55.0%")')
    finish_with_measurements(run)
    page.wait_for_selector('[data-field="status"].state-succeeded')
    page.wait_for_selector("svg.chart")
    assert page.locator("svg.chart").count() == 6
    assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
    save_screenshot(page, "benchmark", for_docs=True)


def test_a_run_draws_its_points_as_they_arrive_and_cancel_keeps_them(
    page: Any, live_server: Any, scenario: Any
) -> None:
    """The page follows a run point by point without a reload: the phase, the charts of the
    points finished so far while it still runs, then Cancel, after which the banner, badge
    and button all say cancelling, then cancelled, and the finished points stay charted.
    The test writes what the runner writes."""
    run = BenchmarkRun.objects.create(
        scenario=scenario,
        target_url="http://127.0.0.1:9/",
        mode="all",
        concurrency=[1, 4],
        status="running",
        phase="warm-up, cpu c=1 (1 of 6 points)",
        points_total=6,
        recorded_under={
            "policy": {"name": "default", "version": 4, "versions_seen": [4]},
            "engines": {"target": "http://127.0.0.1:9/"},
        },
    )
    page.goto(f"{live_server.url}/benchmarks/{run.pk}/")
    assert "No data yet" in page.content()
    assert "default v4" in page.inner_text('[data-recorded="policy"]')
    page.evaluate("window.__sameDocument = true")
    # Two points finish: their rows are stored (the runner's partial summary) and drawn.
    finish_with_measurements(run)
    summary = BenchmarkRun.objects.get(pk=run.pk).summary
    summary["rows"] = [r for r in summary["rows"] if r["mode"] == "cpu"]
    summary["partial"] = True
    BenchmarkSample.objects.filter(run=run).exclude(mode="cpu").delete()
    BenchmarkRun.objects.filter(pk=run.pk).update(
        status="running",
        summary=summary,
        points_done=2,
        progress=0.33,
        phase="2 of 6 points measured",
        finished_at=None,
    )
    page.wait_for_selector('[data-field="points"]:text("2 of 6 points")')
    page.wait_for_selector("svg.chart")
    assert page.locator('[data-field="status"]').inner_text() == "running"
    assert "No data yet" not in page.content()
    # Cancel: the page shows cancelling at once, and the button goes away.
    page.click('[data-field="cancel"] button')
    page.wait_for_selector('[data-field="status"].state-cancelling')
    assert "cancelling" in page.inner_text('[data-field="banner"]')
    assert not page.locator('[data-field="cancel"]').is_visible()
    # The runner stops and keeps its two points.
    BenchmarkRun.objects.filter(pk=run.pk).update(
        status="cancelled", phase="cancelled after 2 of 6 points"
    )
    page.wait_for_selector('[data-field="status"].state-cancelled')
    assert page.inner_text('[data-field="banner"]') == (
        f"Run {run.pk} was cancelled after 2 of 6 points."
    )
    page.wait_for_selector('[data-field="partial"]')
    assert page.locator("svg.chart").count() >= 1
    assert not page.locator('[data-field="cancel"]').is_visible()
    assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
    save_screenshot(page, "benchmark-cancelled", for_docs=True)
