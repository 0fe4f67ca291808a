"""The dashboard in a real browser: Playwright drives Debian's Chromium against a live server.

The server is pytest-django's live server on the test database. Celery tasks run eagerly in
it (the worker itself is covered by tests/controlplane/core/test_celery_live.py), while commands
for the node still travel through the real broker queue to a stand-in agent that answers
through the REST API with an agent token.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from asgiref.sync import SyncToAsync
from django.contrib.auth.models import User
from django.db import connections
from django.utils import timezone

from common.serving import clean_serving
from common.tenants import hash_key
from controlplane.access.models import MachineCredential
from controlplane.batches.choices import BatchStatus, LineStatus
from controlplane.batches.models import Batch, BatchLine
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample
from controlplane.celery import app
from controlplane.deployments.models import Deployment
from controlplane.deployments.placement import check_placement
from controlplane.inventory.models import Node
from controlplane.policy.models import SchedulingPolicy
from controlplane.policy.services import ensure_default_policy
from controlplane.routers.models import RouterInstance
from controlplane.routers.services import record_stats
from controlplane.tenants.models import Tenant, TenantKey
from controlplane.tenants.usage import record_usage
from loadgen.simproc import running_sim
from tests.dashboard.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    StandInAgent,
    ensure_browser,
    save_screenshot,
)
from tests.dashboard.conftest import PASSWORD, finish_with_measurements, seed_finished_run
from tests.dashboard.test_playground import KEY as PLAYGROUND_KEY
from tests.dashboard.test_playground import FakeRouter

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
    "/tenants/",
)
# Ages (seconds before the page opens) of the routers' serving reports the fleet starts with:
# every 10 s for the last three minutes, then a few across the hour and the day.
SERVING_AGES = (*range(0, 180, 10), 600, 1200, 1800, 3000, 7200, 21600, 54000)


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
    deployment = make_deployment(
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
    # The router's reports, oldest first, each with its interval's serving figures; the last
    # one (now) also carries the running counts the routers card shows.
    now = timezone.now()
    served = []
    for step, age in enumerate(sorted(SERVING_AGES, reverse=True)):
        figures = serving_report(deployment, step)
        served.append((age, sum(figures["decisions"].values())))
        stats: dict[str, Any] = {"policy_version": 1, "request_rate": 6.4, "serving": figures}
        if age == 0:
            stats["decisions"] = {"gpu-only": 118, "pd": 243, "cpu-only": 0, "rejected": 2}
        record_stats(router, stats, now=now - timedelta(seconds=age))
    ensure_default_policy()
    run = seed_finished_run(scenario)
    return {
        "node": node,
        "token": token,
        "profile": profile,
        "run": run,
        "deployment": deployment,
        "router": router,
        "served": served,
    }


def serving_report(deployment: Deployment, step: int) -> dict[str, Any]:
    """One 10 s interval of a router's serving figures (common/serving.py) for the traffic of
    ``deployment``'s model; ``step`` varies the figures so the charts have a shape."""
    pd, gpu = 6 + step % 4, 3 + step % 3
    decisions = {"pd": pd, "gpu-only": gpu}
    ttft = {"100": gpu, "250": pd - 1, "1000": 1}
    tpot = {"25": 30 + step % 7, "50": 40, "100": 6}
    tokens = 180.0 + 12.0 * (step % 5)
    engines = [
        {
            "role": "gpu",
            "url": deployment.gpu_endpoint,
            "up": True,
            "running": 6 + step % 3,
            "waiting": (step // 4) % 3,
            "kv_usage_perc": 40.0 + 4.0 * (step % 6),
            "tokens_per_second": tokens,
            "itl_ms": 14.0,
        },
        {
            "role": "cpu",
            "url": deployment.cpu_endpoint,
            "up": True,
            "running": 3 + step % 2,
            "waiting": 0,
            "kv_usage_perc": 12.0 + step % 4,
            "tokens_per_second": round(tokens * 0.3, 1),
            "itl_ms": 31.0,
        },
    ]
    model = deployment.profile.model_name_for_clients
    return clean_serving(
        {
            "interval_seconds": 10.0,
            "decisions": decisions,
            "reasons": {"pd:gpu-kv-full": pd, "gpu-only:gpu-room": gpu},
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "deployments": [
                {
                    "id": deployment.pk,
                    "name": deployment.name,
                    "model": model,
                    "decisions": decisions,
                    "ttft_ms": ttft,
                    "tpot_ms": tpot,
                    "engines": engines,
                }
            ],
        }
    )


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
    assert page.locator(".serving figure[data-chart]").count() == 7  # the live serving charts
    save_screenshot(page, "overview", for_docs=True)

    page.click("nav >> text=Nodes")
    page.click("text=kunpeng-a100")
    assert page.locator("li.core").count() == 160
    assert page.locator("li.core.h0").count() == 128  # the CPU engine's cores
    assert page.locator("li.core.h1").count() == 4  # the GPU engine's host threads
    assert page.locator("figure.socket").count() == 2
    assert page.inner_text("#serving-h") == "Live serving node kunpeng-a100"
    assert page.locator(".serving figure[data-chart]").count() == 7
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
        # A router reports the new deployment's first traffic: its serving panel, empty so
        # far, fills in at its next poll, still without a reload.
        assert page.locator('.serving [data-field="serving-empty"]').is_visible()
        second = Deployment.objects.get(name="qwen32b-second")
        now = timezone.now()
        for step, age in enumerate((20, 10, 0), start=1):
            report = {"serving": serving_report(second, step)}
            record_stats(fleet["router"], report, now=now - timedelta(seconds=age))
        page.wait_for_selector('.serving [data-chart="tokens"]', timeout=20_000)
        assert page.inner_text('.serving [data-field="requests"]') == "36"  # 11 + 13 + 12
        assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
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


def test_the_live_serving_window_switches_without_a_reload(
    page: Any, live_server: Any, fleet: dict[str, Any]
) -> None:
    """The overview's panel sums the routers' reports over 5 min, 1 h or 24 h, switched in
    place; a deployment's page has the same panel, for that deployment only."""

    def requests_in(seconds: int) -> str:
        return str(sum(count for age, count in fleet["served"] if age < seconds))

    panel = page.locator(".serving")
    assert panel.get_attribute("data-window") == "5m"
    assert panel.locator('[data-field="requests"]').inner_text() == requests_in(300)
    assert "gpu-kv-full" in panel.locator("table.serving-reasons").inner_text()
    page.evaluate("window.__sameDocument = true")
    for key, seconds in (("1h", 3600), ("24h", 86400), ("5m", 300)):
        panel.locator(f'[data-window-key="{key}"]').click()
        expected = requests_in(seconds)
        page.wait_for_selector(f'.serving [data-field="requests"]:text-is("{expected}")')
        assert panel.get_attribute("data-window") == key
        assert panel.locator("[aria-current=true]").get_attribute("data-window-key") == key
        assert page.url.endswith(f"?window={key}")
        if key == "24h":
            save_screenshot(page, "overview-24h")
    assert requests_in(300) != requests_in(3600) != requests_in(86400)
    assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"

    page.goto(f"{live_server.url}/deployments/{fleet['deployment'].pk}/?window=1h")
    assert page.inner_text("#serving-h") == "Live serving deployment qwen32b-hetero"
    assert page.inner_text('.serving [data-field="requests"]') == requests_in(3600)
    assert page.locator(".serving table.serving-engines tbody tr").count() == 2  # GPU, CPU
    assert page.locator(".serving figure[data-chart]").count() == 7
    save_screenshot(page, "deployment-serving")


@pytest.fixture
def playground_router(fleet: dict[str, Any], settings: Any) -> Iterator[FakeRouter]:
    """tests/dashboard/test_playground.py's router stand-in, registered and alive."""
    settings.ROUTER_BENCHMARK_KEY = PLAYGROUND_KEY
    fake = FakeRouter()
    settings.ROUTER_URLS = [fake.url]  # the playground sends only to configured routers
    credential, _ = MachineCredential.issue("router", "router-play")
    RouterInstance.objects.create(
        name="router-play", credential=credential, listen_url=fake.url, last_seen_at=timezone.now()
    )
    yield fake
    fake.close()


def test_the_playground_sends_a_chat_forced_to_pd(
    page: Any, live_server: Any, fleet: dict[str, Any], playground_router: FakeRouter
) -> None:
    page.goto(f"{live_server.url}/deployments/{fleet['deployment'].pk}/")
    section = page.locator("section.playground")
    assert "router-play" in section.inner_text()
    page.fill("#id_play-prompt", "Say hello to the operators")
    page.fill("#id_play-max_tokens", "16")
    page.select_option("#id_play-mode", "forced-pd")
    page.evaluate("window.__sameDocument = true")
    section.locator("button[type=submit]").click()
    page.wait_for_selector('[data-field="play-route"]:text-is("pd")')
    assert page.inner_text('[data-field="play-reason"]') == "forced"
    ttft, unit = page.inner_text('[data-field="play-ttft"]').split()
    assert unit == "ms" and float(ttft) >= 40  # the stand-in's 50 ms prefill
    rate, unit = page.inner_text('[data-field="play-tps"]').split()
    assert unit == "tokens/s" and float(rate) > 0
    assert page.inner_text('[data-field="play-tokens"]') == "4"
    assert page.inner_text('[data-field="play-router"]') == "router-play"
    assert page.inner_text('[data-field="play-text"]') == "Hello from the engines"
    assert not page.locator('[data-field="play-error"]').is_visible()
    assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
    sent = playground_router.seen[-1]
    assert sent["headers"]["X-Syshax-Mode"] == "forced-pd"
    assert sent["body"]["max_tokens"] == 16
    section.scroll_into_view_if_needed()
    save_screenshot(page, "playground", for_docs=True)


def test_create_a_tenant_and_issue_and_revoke_its_key(
    page: Any, live_server: Any, fleet: dict[str, Any]
) -> None:
    base = live_server.url
    page.click("nav >> text=Tenants")
    assert page.locator("h1").inner_text() == "Tenants"
    # Three problems in one submission: all three shown at once, nothing created.
    page.fill("#id_name", "Eval Team")
    page.fill("#id_rpm_limit", "-5")
    page.uncheck("#new input[name=classes][value=interactive]")
    page.uncheck("#new input[name=classes][value=standard]")
    page.select_option("#id_default_class", "standard")
    page.click("button:text('Create tenant')")
    assert "fix 3 problems" in page.inner_text("#new .error-summary")
    assert page.locator("#new .error-summary li").count() == 3
    assert page.locator("#new .field.invalid").count() == 3
    assert not Tenant.objects.exists()

    page.fill("#id_name", "eval-team")
    page.fill("#id_rpm_limit", "120")
    page.fill("#id_tpm_limit", "200000")
    page.fill("#id_models", "qwen32b")
    page.check("#new input[name=classes][value=standard]")
    page.click("button:text('Create tenant')")
    page.wait_for_selector("text=tenant eval-team created")
    assert page.locator("h1").inner_text() == "Tenant eval-team"
    tenant = Tenant.objects.get(name="eval-team")
    assert (tenant.rpm_limit, tenant.classes) == (120, ["standard", "batch"])

    # The routers report an hour of its traffic, a minute at a time, some of it over its RPM.
    now = timezone.now()
    for minute in range(0, 60, 3):
        counts = {
            "requests": 40 + minute,
            "prompt_tokens": 3000 + 50 * minute,
            "completion_tokens": 1200 + 20 * minute,
            "rejected": {"rpm": minute % 4},
        }
        at = now - timedelta(minutes=minute)
        record_usage(fleet["router"], {"tenants": {"eval-team": counts}}, now=at)

    # A key is shown once, on the page that issued it, and never again.
    page.fill("#id_label", "eval jobs")
    page.click("button:text('Issue key')")
    key = page.inner_text("#new-key")
    stored = TenantKey.objects.get(tenant=tenant)
    assert key.startswith(stored.prefix) and stored.key_hash == hash_key(key)
    page.goto(f"{base}/tenants/eval-team/")
    assert page.locator("#new-key").count() == 0 and key not in page.content()
    assert page.locator("#usage svg.chart").count() == 3  # requests, tokens, rejections
    assert "rpm" in page.inner_text("#usage table.usage")

    page.click("button[aria-label^='Revoke key']")
    page.wait_for_selector("text=revoked; routers refuse it from their next poll")
    assert TenantKey.objects.get(tenant=tenant).revoked_at is not None
    save_screenshot(page, "tenant", for_docs=True)

    page.click("nav >> text=Tenants")
    row = page.locator("tr", has=page.locator('a[href="/tenants/eval-team/"]'))
    assert "120" in row.inner_text() and "rpm" in row.inner_text()
    save_screenshot(page, "tenants", for_docs=True)


def seed_batch(owner: str, status: str, total: int, completed: int, failed: int) -> Batch:
    """A batch part or wholly run, as the batch worker leaves it: its counts and its lines."""
    now = timezone.now()
    batch = Batch.objects.create(
        owner=owner,
        endpoint="/v1/chat/completions",
        status=status,
        input_file_ref="file-eval-prompts",
        total=total,
        completed=completed,
        failed=failed,
        created_at=now - timedelta(minutes=12),
        in_progress_at=now - timedelta(minutes=11),
        completed_at=now if status == BatchStatus.COMPLETED else None,
        expires_at=now + timedelta(hours=24),
        metadata={"job": "nightly-eval"},
    )
    lines = []
    for n in range(1, total + 1):
        state = (
            LineStatus.DONE
            if n <= completed
            else LineStatus.FAILED
            if n <= completed + failed
            else LineStatus.PENDING
        )
        error = None
        if state == LineStatus.FAILED:
            error = {"code": "model_not_found", "message": f"line {n}: model 'qwen72b' not served"}
        lines.append(
            BatchLine(batch=batch, line_no=n, custom_id=f"eval-{n}", status=state, error=error)
        )
    BatchLine.objects.bulk_create(lines)
    return batch


def test_batches_show_their_progress(page: Any, live_server: Any) -> None:
    moving = seed_batch("eval-team", BatchStatus.IN_PROGRESS, total=40, completed=22, failed=2)
    done = seed_batch("globex", BatchStatus.COMPLETED, total=12, completed=12, failed=0)
    page.click("nav >> text=Batches")
    assert page.locator("h1").inner_text() == "Batches"
    bar = page.locator("tr", has=page.locator(f'a[href="/batches/{moving.id}/"]')).locator(
        "progress"
    )
    assert (bar.get_attribute("max"), bar.get_attribute("value")) == ("40", "24")
    finished = page.locator("tr", has=page.locator(f'a[href="/batches/{done.id}/"]'))
    assert "100%" in finished.inner_text()
    save_screenshot(page, "batches", for_docs=True)

    page.click(f"text={moving.id}")
    assert moving.id in page.locator("h1").inner_text()
    progress = page.inner_text("#progress-h + p")
    assert "60%: 22 completed, 2 failed of 40 lines" in progress
    assert page.locator("section progress").get_attribute("value") == "24"
    assert "16 pending, 22 done, 2 failed" in page.inner_text("dl.facts")
    assert page.locator("#failed-h ~ div table tbody tr").count() == 2
    assert "model 'qwen72b' not served" in page.content()
    save_screenshot(page, "batch", for_docs=True)


def test_the_policy_page_lists_the_slo_class_knobs(page: Any, live_server: Any) -> None:
    page.goto(f"{live_server.url}/policy/default/")
    for knob in (
        "class_aware",
        *(f"interactive_{k}" for k in ("ttft_ms", "tpot_ms", "priority", "sheddable")),
        *(f"standard_{k}" for k in ("ttft_ms", "priority", "sheddable", "cpu_first")),
        *(f"batch_{k}" for k in ("ttft_ms", "tpot_ms", "priority", "sheddable", "cpu_first")),
    ):
        assert page.locator(f"#id_{knob}").count() == 1, knob
    assert page.inner_text("#meaning-batch_tpot_ms").startswith("SLO class batch:")
    assert page.is_checked("#id_class_aware") and page.is_checked("#id_batch_cpu_first")
    page.fill("#id_batch_tpot_ms", "250")
    page.fill("#id_reason", "the CPU meets 250 ms for batch decodes")
    page.click("button:text('Save as v2')")
    page.wait_for_selector("text=policy default saved as v2")
    revision = page.locator("#v2")
    assert revision.locator("del").all_inner_texts() == ["300.0"]
    assert revision.locator("ins").all_inner_texts() == ["250.0"]
