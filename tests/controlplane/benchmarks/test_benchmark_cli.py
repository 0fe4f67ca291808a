"""`syshax benchmark --deployment NAME` finds its router and model through the control plane,
and reports the node's resource use during each row from the agents' heartbeats."""

from __future__ import annotations

import json
import threading

import pytest
from django.utils import timezone

from controlplane.access.models import MachineCredential, PersonalToken
from controlplane.inventory.models import Heartbeat
from controlplane.routers.models import RouterInstance
from loadgen.controlplane import summarize_heartbeats
from loadgen.simproc import running_sim
from syshax.cli import main as syshax_main


def test_heartbeats_summarize_to_mean_and_peak() -> None:
    beats = [
        {
            "cpu_percent": 20,
            "memory_used_bytes": 2 * 1024**3,
            "accelerators": [{"utilization_percent": 50, "memory_used_bytes": 10 * 1024**3}],
        },
        {
            "cpu_percent": 40,
            "memory_used_bytes": 3 * 1024**3,
            "accelerators": [{"utilization_percent": 70, "memory_used_bytes": 12 * 1024**3}],
        },
    ]
    summary = summarize_heartbeats(beats)
    assert summary["cpu_percent_mean"] == 30 and summary["cpu_percent_max"] == 40
    assert summary["memory_used_gb_max"] == 3 and summary["accelerator_util_mean"] == 60
    assert summary["accelerator_memory_used_gb_max"] == 12
    assert summarize_heartbeats([])["cpu_percent_mean"] is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.process
def test_benchmark_a_deployment_through_the_control_plane(
    live_server, admin_user, make_deployment, tmp_path, capsys, settings
) -> None:
    token = PersonalToken.issue(admin_user, "cli")[1]
    with running_sim("a100-80gb", speed=20.0) as engine:
        settings.ROUTER_URLS = [engine]  # the run goes to a configured router only
        deployment = make_deployment(state="running", gpu_endpoint=engine)
        credential = MachineCredential.issue("router", "r1")[0]
        RouterInstance.objects.create(
            name="r1", credential=credential, listen_url=engine, last_seen_at=timezone.now()
        )
        stop = threading.Event()

        def heartbeat() -> None:  # the node's agent, reporting while the load runs
            while not stop.wait(0.005):
                Heartbeat.objects.create(
                    node=deployment.node,
                    cpu_percent=55.0,
                    memory_used_bytes=4 * 1024**3,
                    accelerators=[
                        {
                            "uuid": "x",
                            "utilization_percent": 80.0,
                            "memory_used_bytes": 64 * 1024**3,
                        }
                    ],
                )

        beats = threading.Thread(target=heartbeat)
        beats.start()
        try:
            status = syshax_main(
                [
                    "benchmark",
                    "--deployment",
                    deployment.name,
                    "--control-plane",
                    live_server.url,
                    "--token",
                    token,
                    "--mode",
                    "gpu",
                    "--scenario",
                    "custom",
                    "--input-tokens",
                    "8",
                    "--output-tokens",
                    "8",
                    "--concurrency",
                    "2",
                    "--iterations",
                    "6",
                    "--no-progress",
                    "--json",
                    str(tmp_path / "out.json"),
                ]
            )
        finally:
            stop.set()
            beats.join()
    out = capsys.readouterr()
    assert status == 0, out.err
    assert f"model {deployment.profile.model} through router {engine}" in out.err
    assert "node resource use" in out.out
    row = json.loads((tmp_path / "out.json").read_text())["rows"][0]
    assert row["resources"]["cpu_percent_mean"] == 55.0
    assert row["resources"]["accelerator_memory_used_gb_max"] == 64.0


@pytest.mark.django_db(transaction=True)
def test_an_unknown_or_stopped_deployment_is_a_clear_error(live_server, admin_user, capsys) -> None:
    token = PersonalToken.issue(admin_user, "cli")[1]
    status = syshax_main(
        ["benchmark", "--deployment", "nope", "--control-plane", live_server.url, "--token", token]
    )
    assert status == 2
    assert "deployment 'nope' is not running (or does not exist)" in capsys.readouterr().err
    status = syshax_main(["benchmark", "--deployment", "nope", "--control-plane", live_server.url])
    assert status == 2
    assert "give a user's API token" in capsys.readouterr().err
