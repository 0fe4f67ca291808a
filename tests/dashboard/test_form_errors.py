"""The dashboard's forms show every problem in one round, the policy page says which routers
applied the current version, and the benchmark form's defaults make a short run."""

from __future__ import annotations

import math
import re

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from common.policy_schema import PolicyError, knob_errors, validate_knobs
from common.presets import DEVICES, MODELS
from controlplane.access.models import MachineCredential
from controlplane.benchmarks.models import BenchmarkRun
from controlplane.dashboard import services as reads
from controlplane.dashboard.forms import DEFAULT_ITERATIONS, DEFAULT_LEVELS
from controlplane.deployments.models import Deployment
from controlplane.deployments.placement import PlacementError, check_placement, choose
from controlplane.policy.models import SchedulingPolicy
from controlplane.policy.services import ensure_default_policy, update_policy
from controlplane.routers.services import record_stats, register_router
from sim.perfmodel import decode_step_time, effective_hardware, prefill_time
from syshax.commands.up_stack import SIM_MODEL
from tests.dashboard.conftest import seed_finished_run

pytestmark = pytest.mark.django_db


def _summary(html: str) -> str:
    match = re.search(r'<div class="errors error-summary" role="alert">(.*?)</div>', html, re.S)
    assert match, "no error summary above the form"
    return match.group(1)


def _policy_post(policy: SchedulingPolicy, **changes: object) -> dict[str, object]:
    data: dict[str, object] = {k: v for k, v in policy.knobs().items() if v is not False}
    data.update(changes)
    return data


def test_knob_errors_lists_every_bad_knob_and_validate_knobs_still_raises_the_first() -> None:
    data = {**ensure_default_policy().knobs(), "gpu_cache_threshold": 150, "max_num_seqs": 0}
    errors = knob_errors(data)
    assert [(e.field, e.message) for e in errors] == [
        ("max_num_seqs", "must be at least 1; got 0"),
        ("gpu_cache_threshold", "must be at most 100; got 150.0"),
    ]
    with pytest.raises(PolicyError) as raised:
        validate_knobs(data)
    assert (raised.value.field, raised.value.message) == ("max_num_seqs", errors[0].message)
    assert knob_errors({"token_limit_min": 50, "token_limit_max": 20}, partial=True)[0].field == (
        "token_limit_min"
    )
    assert knob_errors({"mode": "auto"}, partial=True) == []


def test_policy_shows_every_error_in_one_round(operator_client: Client) -> None:
    policy = ensure_default_policy()
    url = reverse("dashboard:policy", args=["default"])
    response = operator_client.post(
        url,
        _policy_post(
            policy,
            gpu_cache_threshold="150",
            max_num_seqs="0",
            metrics_interval_seconds="often",
            mode="sometimes",
        ),
    )
    html = response.content.decode()
    assert response.status_code == 400
    messages = [
        "This field is required.",  # the reason
        "must be at most 100; got 150.0",
        "must be at least 1; got 0",
        "Enter a number.",
        "Select a valid choice. sometimes is not one of the available choices.",
    ]
    summary = _summary(html)
    assert "Fix 5 problems" in summary
    for message in messages:
        # Beside its field, and in the summary above the form.
        assert f'<p class="field-error" role="alert">{escape(message)}</p>' in html
        assert escape(message) in summary
    assert '<a href="#id_gpu_cache_threshold">gpu_cache_threshold</a>' in summary
    # A rule across knobs and a missing reason show together too.
    crossed = operator_client.post(url, _policy_post(policy, token_limit_min=500))
    crossed_html = crossed.content.decode()
    assert crossed.status_code == 400
    assert "must not exceed token_limit_max (500 &gt; 100)" in crossed_html
    assert "This field is required." in crossed_html
    policy.refresh_from_db()
    assert policy.version == 1 and policy.gpu_cache_threshold == 90.0
    assert policy.revisions.count() == 1


def test_deployment_shows_form_and_placement_errors_together(
    operator_client: Client, make_node, make_profile, make_deployment
) -> None:
    existing = make_deployment(name="taken")
    node = make_node("small-box", accelerators=1, accel_gb=16)
    profile = make_profile(tensor_parallel_size=2)
    url = reverse("dashboard:deployment-create")
    response = operator_client.post(
        url, {"name": "taken", "profile": profile.pk, "node": node.name}
    )
    html = response.content.decode()
    assert response.status_code == 400
    summary = _summary(html)
    problems = check_placement(profile, node)
    assert len(problems) >= 1
    expected = ["a deployment named 'taken' already exists"]
    expected += [f"{p.field}: {p.message}" for p in problems]
    for message in expected:
        assert escape(message) in html and escape(message) in summary
    # Without a node, the scheduler's refusal shows beside the name's.
    unplaced = operator_client.post(
        url, {"name": "taken", "profile": profile.pk, "node": "", "node_selector": "rack=nowhere"}
    )
    with pytest.raises(PlacementError) as refused:
        choose(Deployment(profile=profile, pinned=False, node_selector={"rack": "nowhere"}))
    unplaced_html = unplaced.content.decode()
    assert unplaced.status_code == 400
    assert escape("a deployment named 'taken' already exists") in unplaced_html
    assert escape(refused.value.message) in unplaced_html
    assert list(Deployment.objects.values_list("pk", flat=True)) == [existing.pk]


def test_benchmark_shows_every_error_in_one_round(operator_client: Client, scenario) -> None:
    response = operator_client.post(
        reverse("dashboard:benchmark-create"),
        dict(
            scenario="short",
            target_url="http://10.9.9.9:1234/",  # no router or engine of this fleet
            mode="hetero",
            concurrency="0,5000",
            iterations="0",
            warmup="20000",
            request_rates="1,2",  # a sweep, with no SLO
        ),
    )
    html = response.content.decode()
    assert response.status_code == 400
    summary = _summary(html)
    messages = [
        "each level must be between 1 and 1024",  # the form's conversion
        "a goodput sweep needs an SLO TTFT or TPOT",  # the form's rule across fields
        "10.9.9.9:1234 is neither a configured router",  # the service
        "Ensure this value is greater than or equal to 1.",  # the model: iterations
        "Ensure this value is less than or equal to 10000.",  # the model: warmup
    ]
    for message in messages:
        assert escape(message) in html and escape(message) in summary
    assert not BenchmarkRun.objects.exists()


def test_policy_page_lists_the_routers_that_applied_the_current_version(
    operator_client: Client,
) -> None:
    policy = ensure_default_policy()
    update_policy(policy, changes={"cpu_max_batch_size": 12}, acting_user="test", reason="more")
    reported = {"router-new": 2, "router-old": 1, "router-quiet": None}
    for name, version in reported.items():
        credential, _ = MachineCredential.issue("router", name)
        router = register_router(credential, name=name, version="1", listen_url="")
        if version is not None:
            record_stats(router, {"policy_version": version, "decisions": {}})
    html = operator_client.get(reverse("dashboard:policy", args=["default"])).content.decode()
    assert "1 of 3 routers applied v2" in html
    row_pattern = r'<tr class="(?:applied|pending)"><th scope="row">([\w-]+).*?</tr>'
    rows = {m.group(1): m.group(0) for m in re.finditer(row_pattern, html, re.S)}
    assert set(rows) == set(reported)
    assert 'class="applied"' in rows["router-new"] and "<td>v2</td>" in rows["router-new"]
    assert 'class="pending"' in rows["router-old"] and "<td>v1</td>" in rows["router-old"]
    assert "not applied" in rows["router-quiet"] and "none yet" in rows["router-quiet"]
    seen = timezone.localtime(timezone.now()).strftime("%Y-%m-%d")
    for row in rows.values():
        assert "<time datetime=" in row and seen in row  # the last poll of each
    # The pending ones come first: they are what the operator is waiting for.
    assert html.index("router-old") < html.index("router-new")
    other = SchedulingPolicy.objects.create(name="batch")
    other_html = operator_client.get(reverse("dashboard:policy", args=[other.name])).content
    assert b"Routers report the version of the default policy" in other_html


def _simulated_request_seconds(input_tokens: int, output_tokens: int, batch: int) -> float:
    """One request of the scenario on the simulated A100 of ``make up``, by the simulator's
    own timing model (hetero mode decodes on the GPU while it is not saturated)."""
    hw = effective_hardware(DEVICES["a100-80gb"])
    model = MODELS[SIM_MODEL]
    steps = (decode_step_time(hw, model, batch, input_tokens + i) for i in range(output_tokens))
    return prefill_time(hw, model, input_tokens) + sum(steps)


def test_benchmark_form_defaults_finish_in_a_minute_or_two(
    operator_client: Client, scenario
) -> None:
    for url in (reverse("dashboard:benchmarks"), reverse("dashboard:benchmark-create")):
        html = operator_client.get(url).content.decode()
        assert f'value="{DEFAULT_LEVELS}"' in html and f'value="{DEFAULT_ITERATIONS}"' in html
        assert "This run sends 32 requests in 15 rounds one after another" in html
        assert "No run of this scenario has been measured yet" in html
    levels = [int(c) for c in DEFAULT_LEVELS.split(",")]
    seconds = sum(
        math.ceil(DEFAULT_ITERATIONS / level)
        * _simulated_request_seconds(scenario.input_tokens, scenario.output_tokens, level)
        for level in levels
    )
    assert 20 < seconds < 120, f"the default run takes about {seconds:.0f} s"
    # Once a run of the scenario is measured, the form times the run with it.
    run = seed_finished_run(scenario)
    estimate = reads.run_estimate(scenario, "hetero", levels, DEFAULT_ITERATIONS, 0)
    assert estimate is not None and estimate.measured_run == run.pk
    assert estimate.seconds is not None and estimate.rounds == 15
    html = operator_client.get(reverse("dashboard:benchmarks")).content.decode()
    assert (
        f"about {estimate.seconds:.0f} s at {estimate.seconds_per_request:.1f} s a request" in html
    )
    assert f"run #{run.pk}</a> of this scenario" in html
    # A sweep's length depends on what it measures: no estimate.
    assert reads.run_estimate(scenario, "hetero", levels, 8, 0, request_rates=[1.0]) is None
