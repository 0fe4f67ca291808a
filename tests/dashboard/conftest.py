"""Fixtures for the dashboard tests: one object each, and signed-in browsers of each kind."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample, Scenario
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.inventory.models import Node
from loadgen.records import RequestRecord
from loadgen.report import Row, to_json
from loadgen.stats import summarize
from testbed.factories import build_deployment, build_node, build_profile

PASSWORD = "dashboard-test-pass-1"


# Dashboard pictures read best on a Kunpeng-shaped node: 2 sockets, 4 NUMA nodes of 8 cores.
KUNPENG_SHAPE: dict[str, Any] = {
    "prefix": "dash-node",
    "sockets": 2,
    "numa": 4,
    "cores_per_numa": 8,
    "cpu_model": "Kunpeng-920 (test)",
    "architecture": "aarch64",
    "isa_flags": ("asimd", "sve", "i8mm"),
    "accel_used_fraction": 0.25,
    "accel_utilization": 37.5,
}


@pytest.fixture
def make_node(db: Any):
    def make(name: str | None = None, **fields: Any) -> Node:
        return build_node(name, **{**KUNPENG_SHAPE, **fields})

    return make


@pytest.fixture
def make_profile(db: Any):
    def make(**fields: Any) -> DeploymentProfile:
        return build_profile(prefix="dash-profile", **fields)

    return make


@pytest.fixture
def make_deployment(db: Any, make_node, make_profile):
    def make(**fields: Any) -> Deployment:
        node = fields.pop("node", None) or make_node()
        profile = fields.pop("profile", None) or make_profile()
        return build_deployment(node, profile, prefix="dash-dep", **fields)

    return make


@pytest.fixture
def scenario(db: Any) -> Scenario:
    # Transactional tests flush the migrations' built-in rows, so make sure it exists.
    found, _ = Scenario.objects.get_or_create(
        name="short",
        defaults={
            "description": "chat (MISSION.md)",
            "input_tokens": 128,
            "output_tokens": 256,
            "concurrency_min": 1,
            "concurrency_max": 16,
        },
    )
    return found


def _records(ttft_ms: float, tpot_ms: float, concurrency: int, count: int) -> list[RequestRecord]:
    """Requests sent in waves of ``concurrency``; timings vary by a fixed pattern, not at random."""
    records = []
    wave_start = 0.0
    for index in range(count):
        if index and index % concurrency == 0:
            wave_start += (ttft_ms + tpot_ms * 255) * 1.2 / 1000.0
        spread = 1.0 + 0.25 * ((index * 7) % 16) / 16.0
        first = wave_start + ttft_ms * spread / 1000.0
        gaps = tpot_ms * spread * (1.0 + 0.05 * concurrency) / 1000.0
        records.append(
            RequestRecord(
                index=index,
                prompt_tokens=128,
                max_tokens=256,
                sent_at=wave_start,
                chunk_times=[first + gaps * k for k in range(256)],
                ok=True,
            )
        )
    return records


def seed_finished_run(
    scenario: Scenario, *, with_summary: bool = True, target_url: str = "http://127.0.0.1:9/"
) -> BenchmarkRun:
    """A finished run of three modes at two levels, shaped like MISSION.md's short-scenario
    claims (a stand-in measurement: the dashboard's charts are what is under test). Its summary
    is built by the load generator's own summarize/to_json, so it has the stored format."""
    run = BenchmarkRun.objects.create(
        name="seeded",
        scenario=scenario,
        target_url=target_url,
        mode="all",
        concurrency=[1, 4],
        iterations=16,
    )
    return finish_with_measurements(run, with_summary=with_summary)


def finish_with_measurements(run: BenchmarkRun, *, with_summary: bool = True) -> BenchmarkRun:
    """Store what the runner stores at the end of a run: samples, summary, status."""
    target_url = run.target_url
    base = {"cpu": (892.0, 30.7), "gpu": (146.0, 6.3), "hetero": (153.0, 4.6)}
    rows, samples = [], []
    for mode, (ttft, tpot) in base.items():
        for concurrency in (1, 4):
            records = _records(ttft, tpot, concurrency, 16)
            duration = max(r.chunk_times[-1] for r in records)
            rows.append(
                Row(mode, concurrency, target_url, "qwen32b", summarize(records, duration), records)
            )
            for record in records:
                sample = record.sample()
                samples.append(
                    BenchmarkSample(
                        run=run,
                        mode=mode,
                        concurrency=concurrency,
                        index=record.index,
                        ok=True,
                        prompt_tokens=128,
                        output_tokens=int(sample["output_tokens"]),
                        ttft_ms=sample["ttft_ms"],
                        tpot_ms=sample["tpot_ms"],
                        e2e_ms=sample["e2e_ms"],
                        started_at=record.sent_at,
                    )
                )
    BenchmarkSample.objects.bulk_create(samples)
    if with_summary:
        run.summary = to_json({"run": run.pk, "seeded": True}, rows, samples=False)
    run.status, run.progress, run.finished_at = "succeeded", 1.0, timezone.now()
    run.save(update_fields=["summary", "status", "progress", "finished_at"])
    return run


@pytest.fixture
def finished_run(scenario: Scenario) -> BenchmarkRun:
    return seed_finished_run(scenario)


def _login(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator(db: Any) -> User:
    """A non-superuser holding the permissions an operators' group would grant."""
    user = User.objects.create_user("operator", password=PASSWORD)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label__in=["deployments", "policy", "benchmarks", "inventory"]
        )
    )
    return user


@pytest.fixture
def operator_client(operator: User) -> Client:
    return _login(operator)


@pytest.fixture
def viewer_client(db: Any) -> Client:
    """Signed in, but without any model permission: may look, may not act."""
    return _login(User.objects.create_user("viewer", password=PASSWORD))


@pytest.fixture(autouse=True)
def _loopback_benchmark_targets(settings) -> None:
    """The tests benchmark engines they start on this host's loopback, on any port."""
    settings.BENCHMARK_ALLOWED_TARGETS = ["127.0.0.1", "localhost"]
