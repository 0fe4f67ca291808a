"""The live serving panels (docs/dashboard.md, "Live serving"): routers' serving figures
stored with each stats sample, summed over a window by the JSON view, drawn on the overview,
deployment and node pages; old samples pruned."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.access.models import MachineCredential
from controlplane.dashboard import live
from controlplane.gateway import payloads
from controlplane.routers import services
from controlplane.routers.api.serializers import StatsSerializer
from controlplane.routers.models import RouterInstance, RouterStatsSample


def serving(
    deployment_id: int, name: str, *, pd: int = 3, gpu: int = 1, tps: float = 40.0
) -> dict[str, Any]:
    """One router interval: ``pd`` + ``gpu`` requests of the deployment's model."""
    engines = [
        {
            "role": "gpu",
            "url": "http://gpu:7001",
            "up": True,
            "running": 4,
            "waiting": 1,
            "kv_usage_perc": 30.0,
            "tokens_per_second": tps,
            "itl_ms": 12.0,
        },
        {
            "role": "cpu",
            "url": "http://cpu:7002",
            "up": True,
            "running": 2,
            "waiting": 0,
            "kv_usage_perc": 10.0,
            "tokens_per_second": tps / 4,
            "itl_ms": 45.0,
        },
    ]
    decisions = {"pd": pd, "gpu-only": gpu}
    return {
        "interval_seconds": 10.0,
        "decisions": decisions,
        "reasons": {"pd:short-prompt": pd, "gpu-only:gpu-room": gpu},
        "ttft_ms": {"100": pd + gpu},
        "tpot_ms": {"10": 20, "50": 20},
        "deployments": [
            {
                "id": deployment_id,
                "name": name,
                "model": "m",
                "decisions": decisions,
                "ttft_ms": {"100": pd + gpu},
                "tpot_ms": {"10": 20, "50": 20},
                "engines": engines,
            }
        ],
    }


def stats(**serving_fields: Any) -> dict[str, Any]:
    return {
        "policy_version": 2,
        "request_rate": 0.4,
        "decisions": {"pd": 3},
        "serving": serving_fields,
    }


@pytest.fixture
def router(db: Any) -> RouterInstance:
    credential, _ = MachineCredential.issue("router", "router-s")
    return RouterInstance.objects.create(name="router-s", credential=credential)


def add_sample(router: RouterInstance, ago: timedelta, figures: dict[str, Any]) -> None:
    RouterStatsSample.objects.create(
        router=router, received_at=timezone.now() - ago, serving=figures, decisions={}
    )


def test_a_report_with_serving_figures_is_validated_and_stored(router, make_deployment) -> None:
    d = make_deployment()
    body = stats(**serving(d.pk, d.name))
    validator = StatsSerializer(data=body)
    assert validator.is_valid(), validator.errors
    assert payloads.router_stats(body) == validator.validated_data  # the gateway agrees
    services.record_stats(router, validator.validated_data)
    sample = RouterStatsSample.objects.get(router=router)
    assert sample.serving["deployments"][0]["engines"][0]["running"] == 4
    assert sample.serving["reasons"] == {"pd:short-prompt": 3, "gpu-only:gpu-room": 1}
    # The batch path (the machine gateway's, one statement on PostgreSQL) stores them too.
    stored = services.record_stats_batch(
        [(router.pk, router.credential_id, validator.validated_data)]
    )
    assert stored == {(router.pk, router.credential_id)}
    assert [s.serving["decisions"] for s in RouterStatsSample.objects.filter(router=router)] == [
        {"pd": 3, "gpu-only": 1}
    ] * 2
    # An older router's report, without the figures, stores an empty object.
    old = StatsSerializer(data={"policy_version": 2})
    assert old.is_valid()
    services.record_stats_batch([(router.pk, router.credential_id, old.validated_data)])
    assert RouterStatsSample.objects.filter(router=router, serving={}).count() == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"interval_seconds": -1},
        {"interval_seconds": 10, "ttft_ms": {"abc": 1}},
        {"interval_seconds": 10, "decisions": {"pd": -2}},
        {
            "interval_seconds": 10,
            "deployments": [
                {"id": 1, "name": "x", "model": "m", "engines": [{"role": "npu", "url": "u"}]}
            ],
        },
        {"interval_seconds": 10, "reasons": {"pd:\x00": 1}},
        [],
        # Figures that could not happen (docs/decisions/0057-...): refused at the door.
        {"interval_seconds": 10, "decisions": {"pd": 10**9 + 1}},
        {"interval_seconds": 86_401},
        {"interval_seconds": 10, "ttft_ms": {"1e308": 1}},
        *(
            {"interval_seconds": 10, **serving(1, "d", tps=1.0)} | {"deployments": [entry]}
            for entry in [
                {
                    **serving(1, "d")["deployments"][0],
                    "engines": [{**serving(1, "d")["deployments"][0]["engines"][0], **change}],
                }
                for change in (
                    {"tokens_per_second": 1e308},
                    {"tokens_per_second": 1e7 + 1},
                    {"itl_ms": 86_400_001},
                    {"kv_usage_perc": 100.5},
                    {"running": 10**9 + 1},
                )
            ]
        ),
    ],
)
def test_a_malformed_serving_report_is_refused_by_both_readers(bad: Any) -> None:
    body = {"serving": bad}
    validator = StatsSerializer(data=body)
    assert not validator.is_valid()
    assert "serving" in validator.errors
    assert payloads.router_stats(body) is None


def test_the_json_view_sums_a_window_and_says_its_units(
    router, make_deployment, viewer_client
) -> None:
    d = make_deployment()
    other = make_deployment()
    add_sample(router, timedelta(minutes=2), serving(d.pk, d.name, pd=3, gpu=1))
    add_sample(router, timedelta(minutes=30), serving(d.pk, d.name, pd=1, gpu=5))
    add_sample(router, timedelta(hours=3), serving(other.pk, other.name, pd=0, gpu=10))
    add_sample(router, timedelta(hours=30), serving(d.pk, d.name, pd=100, gpu=0))  # too old
    url = reverse("dashboard:serving-json")

    five = viewer_client.get(url, {"window": "5m"}).json()
    assert five["units"]["tokens_per_second"] == "tokens/s"
    assert five["units"]["ttft_p50_ms"] == "ms" and five["units"]["kv_usage_perc"] == "%"
    assert (five["window"], five["seconds"], five["step_seconds"]) == ("5m", 300, 10)
    assert len(five["points"]) == 30
    assert five["summary"]["requests"] == 4
    assert five["summary"]["pd_share_percent"] == 75.0
    assert five["summary"]["reasons"][0] == {
        "route": "pd",
        "reason": "short-prompt",
        "count": 3,
        "percent": 75,
    }
    assert 10 < five["summary"]["ttft_p50_ms"] <= 100
    assert five["summary"]["tpot_p50_ms"] == 10.0
    assert five["summary"]["tokens_per_second"] == 50.0  # GPU 40 + CPU 10
    engines = {e["role"]: e for e in five["engines"]}
    assert (
        engines["gpu"]["latest"]["running"] == 4
        and engines["cpu"]["latest"]["kv_usage_perc"] == 10.0
    )
    assert five["charts"]["tokens"].startswith("<svg") and "tokens/s" in five["charts"]["tokens"]
    assert "Live serving" not in five["html"] and "short-prompt" in five["html"]

    hour = viewer_client.get(url, {"window": "1h"}).json()
    assert hour["summary"]["requests"] == 10 and hour["summary"]["pd_share_percent"] == 40.0
    day = viewer_client.get(url, {"window": "24h"}).json()
    assert day["summary"]["requests"] == 20 and day["step_seconds"] == 1200

    # One deployment, one node: only their figures.
    mine = viewer_client.get(url, {"window": "24h", "deployment": d.pk}).json()
    assert mine["summary"]["requests"] == 10 and mine["scope"] == f"deployment {d.name}"
    theirs = viewer_client.get(url, {"window": "24h", "node": other.node.name}).json()
    assert theirs["summary"]["requests"] == 10 and theirs["summary"]["pd_share_percent"] == 0.0
    assert viewer_client.get(url, {"deployment": "999999"}).status_code == 404
    assert viewer_client.get(url, {"window": "bogus"}).json()["window"] == "5m"


def test_the_json_view_is_finite_whatever_the_samples_hold(
    router, make_deployment, viewer_client
) -> None:
    """Samples stored before the bounds (or by any other path) with 1e308 tokens/s on several
    engines: each reading is capped before it is summed, and the JSON stays valid."""
    d = make_deployment()
    for ago in (1, 2, 3):
        add_sample(router, timedelta(seconds=ago), serving(d.pk, d.name, tps=1e308))

    def no_constants(name: str) -> float:
        raise AssertionError(f"{name} in /live/serving.json")

    url = reverse("dashboard:serving-json")
    for window in ("5m", "1h", "24h"):
        body = viewer_client.get(url, {"window": window}).content.decode()
        data = json.loads(body, parse_constant=no_constants)
        assert data["summary"]["tokens_per_second"] == 2e7  # GPU and CPU, each capped at 1e7
        json.dumps(data, allow_nan=False)
    assert live.finite({"a": [float("inf"), float("nan"), 1.5]}) == {"a": [None, None, 1.5]}


def test_the_json_view_needs_a_sign_in(client, db) -> None:
    answer = client.get(reverse("dashboard:serving-json"))
    assert answer.status_code == 302


def test_pages_show_the_panel(router, make_deployment, operator_client) -> None:
    d = make_deployment()
    add_sample(router, timedelta(seconds=30), serving(d.pk, d.name))
    for url in (
        reverse("dashboard:overview"),
        reverse("dashboard:deployment", args=[d.pk]),
        reverse("dashboard:node", args=[d.node.name]),
    ):
        html = operator_client.get(url, {"window": "1h"}).content.decode()
        assert "Live serving" in html, url
        assert 'data-live-serving="' in html and 'data-window="1h"' in html
        assert "Generated tokens/s" in html and "Time to first token (ms)" in html
        assert "KV-cache use (%) per engine" in html and "Running sequences per engine" in html
        assert "serving.js" in html
    overview = operator_client.get(reverse("dashboard:overview")).content.decode()
    assert "short-prompt" in overview  # the reasons, fleet-wide


def test_a_page_without_figures_says_so(operator_client, make_deployment) -> None:
    d = make_deployment()
    html = operator_client.get(reverse("dashboard:deployment", args=[d.pk])).content.decode()
    assert "No serving figures in the last 5 min" in html


def test_old_samples_are_pruned(router) -> None:
    add_sample(router, timedelta(hours=25), {})
    add_sample(router, timedelta(hours=30), {})
    add_sample(router, timedelta(hours=1), {})
    assert services.prune_samples(24, batch=1) == 2
    assert RouterStatsSample.objects.count() == 1


def test_aggregate_counts_a_model_once_and_averages_engines_across_routers() -> None:
    now = timezone.now()
    figures = serving(1, "a")
    twin = dict(
        figures,
        deployments=[*figures["deployments"], {**figures["deployments"][0], "id": 2, "name": "b"}],
    )
    window = live.window_of("5m")
    # Two routers report the same engines: readings are averaged, not added.
    data = live.aggregate(
        [(now - timedelta(seconds=5), twin), (now - timedelta(seconds=6), figures)],
        now=now,
        window=window,
        deployments={1, 2},
    )
    assert data["summary"]["requests"] == 8  # each sample's model counted once
    assert data["points"][-1]["tokens_per_second"] == 100.0  # (40 + 10) for each of 2 deployments
