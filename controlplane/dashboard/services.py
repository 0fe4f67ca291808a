"""Read models for the dashboard: the queries behind each page, and nothing that writes.

Writes go through the owning apps' services (deployments, policy, benchmarks); the views call
those directly. What lives here only gathers and shapes rows for the templates and the small
JSON endpoints the pages poll.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import Count
from django.urls import reverse
from django.utils import timezone

from controlplane.benchmarks import analysis
from controlplane.benchmarks import services as benchmark_services
from controlplane.benchmarks.analysis import Recommendation
from controlplane.benchmarks.choices import BenchmarkMode, RunStatus
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample, Scenario
from controlplane.benchmarks.schedules import TASK_NAME
from controlplane.core import tracing
from controlplane.dashboard.benchdata import (
    Figures,
    SampleRow,
    figures_from_samples,
    figures_from_summary,
)
from controlplane.dashboard.topology import Holder, Topology, build_topology
from controlplane.deployments.choices import DeploymentState
from controlplane.deployments.models import Deployment, DeploymentEvent, DeploymentProfile
from controlplane.deployments.placement import PlacementError, check_placement, choose
from controlplane.inventory.choices import NodeStatus
from controlplane.inventory.models import Accelerator, Node
from controlplane.policy.models import SchedulingPolicy
from controlplane.routers.choices import DECISIONS
from controlplane.routers.models import RouterInstance

ATTENTION_DEPLOYMENT_STATES = (DeploymentState.FAILED, DeploymentState.UNKNOWN)


@dataclass(frozen=True)
class Attention:
    level: str  # "error" or "warning"
    text: str
    url: str


def attention_items(
    nodes: Sequence[Node] | None = None, deployments: Sequence[Deployment] | None = None
) -> list[Attention]:
    """Offline or silent nodes, failed or unknown deployments, and flagged regressions.

    A caller that has already loaded every node and deployment (the overview) passes them in
    to save two queries; they are filtered here exactly as the queries would filter them."""
    items: list[Attention] = []
    now = timezone.now()
    if nodes is None:
        nodes = list(Node.objects.exclude(status=NodeStatus.DRAINING))
    if deployments is None:
        deployments = list(Deployment.objects.filter(state__in=ATTENTION_DEPLOYMENT_STATES))
    for node in nodes:
        if node.status == NodeStatus.DRAINING:
            continue
        url = reverse("dashboard:node", args=[node.name])
        if node.status == NodeStatus.OFFLINE:
            items.append(Attention("error", f"node {node.name} is offline", url))
        elif node.status == NodeStatus.ONLINE and not node.is_alive(now):
            items.append(Attention("warning", f"node {node.name} has missed heartbeats", url))
    for deployment in deployments:
        if deployment.state not in ATTENTION_DEPLOYMENT_STATES:
            continue
        reason = f": {deployment.state_reason}" if deployment.state_reason else ""
        items.append(
            Attention(
                "error" if deployment.state == DeploymentState.FAILED else "warning",
                f"deployment {deployment.name} is {deployment.state}{reason}",
                reverse("dashboard:deployment", args=[deployment.pk]),
            )
        )
    for run in BenchmarkRun.objects.filter(regression=True).select_related("scenario")[:10]:
        items.append(
            Attention(
                "warning",
                f"benchmark {run} regressed against its baseline",
                reverse("dashboard:benchmark", args=[run.pk]),
            )
        )
    return items


def decision_mix(stats: dict[str, Any]) -> list[tuple[str, int, float]]:
    """(decision, count, share %) from a router's latest stats report."""
    raw = stats.get("decisions") if isinstance(stats, dict) else None
    counts = {k: int(v) for k, v in (raw or {}).items() if isinstance(v, int | float)}
    total = sum(counts.values())
    keys = [k for k in DECISIONS if k in counts] + sorted(set(counts) - set(DECISIONS))
    return [(k, counts[k], 100.0 * counts[k] / total if total else 0.0) for k in keys]


def overview() -> dict[str, Any]:
    nodes = list(Node.objects.annotate(deployment_count=Count("deployments")))
    status_counts = Counter(node.status for node in nodes)
    routers = list(RouterInstance.objects.all())
    deployments = list(Deployment.objects.select_related("node", "profile", "policy"))
    return {
        "nodes": nodes,
        "node_status": [
            (value, label, status_counts.get(value, 0)) for value, label in NodeStatus.choices
        ],
        "accelerators": list(Accelerator.objects.select_related("node")),
        "deployments": deployments,
        "routers": [(router, decision_mix(router.stats)) for router in routers],
        "runs": list(BenchmarkRun.objects.select_related("scenario", "deployment")[:8]),
        "attention": attention_items(nodes, deployments),
    }


def accelerator_readings() -> list[dict[str, Any]]:
    """The live figures the overview refreshes in place."""
    return [
        {
            "id": acc.pk,
            "utilization_percent": round(acc.utilization_percent, 1),
            "memory_used_gb": round(acc.memory_used_bytes / 1024**3, 1),
            "memory_total_gb": round(acc.memory_total_gb, 1),
            "memory_percent": round(100.0 * acc.memory_used_bytes / acc.memory_total_bytes, 1)
            if acc.memory_total_bytes
            else 0.0,
            "temperature_c": acc.temperature_c,
        }
        for acc in Accelerator.objects.all()
    ]


def node_topology(node: Node) -> Topology:
    """The node's cores with the engines that hold them, from each deployment's affinity plan."""
    holders: list[Holder] = []
    for deployment in node.deployments.exclude(state=DeploymentState.STOPPED):
        plan = deployment.affinity_plan or {}
        url = reverse("dashboard:deployment", args=[deployment.pk])
        if plan.get("cpuset"):
            holders.append(Holder(f"{deployment.name} CPU engine", str(plan["cpuset"]), url))
        if plan.get("gpu_cpuset"):
            holders.append(
                Holder(f"{deployment.name} GPU engine (host threads)", str(plan["gpu_cpuset"]), url)
            )
    sockets = node.cpu.sockets if hasattr(node, "cpu") else 1
    numa = [(n.index, n.cpus, n.memory_total_bytes) for n in node.numa_nodes.all()]
    return build_topology(numa, sockets, holders)


def timeline(deployment: Deployment, after: int = 0, limit: int = 200) -> dict[str, Any]:
    """The deployment's state and its events newer than ``after`` (what the page polls)."""
    newer = DeploymentEvent.objects.filter(deployment=deployment, pk__gt=after)
    if after:
        events = list(newer.order_by("pk")[:limit])
    else:
        # A first look shows the latest events; later polls fetch forward from there.
        events = list(newer.order_by("-pk")[:limit])[::-1]
    return {
        "id": deployment.pk,
        "state": deployment.state,
        "state_label": deployment.get_state_display(),
        "state_reason": deployment.state_reason,
        "step": deployment.step,
        "generation": deployment.generation,
        "desired_state": deployment.desired_state,
        "gpu_endpoint": deployment.gpu_endpoint,
        "cpu_endpoint": deployment.cpu_endpoint,
        "events": [
            {
                "id": e.pk,
                "created_at": e.created_at.isoformat(),
                "time": timezone.localtime(e.created_at).strftime("%H:%M:%S"),
                "generation": e.generation,
                "step": e.step,
                "level": e.level,
                "message": e.message,
                # With tracing on, the trace of the work that wrote it (docs/tracing.md).
                "trace_id": str(e.detail.get("trace_id", "")),
                "trace_url": tracing.trace_url(str(e.detail.get("trace_id", ""))),
            }
            for e in events
        ],
    }


def run_figures(run: BenchmarkRun) -> tuple[list[Figures], str]:
    """The run's figures and where they came from ("summary", "samples" or "")."""
    figures = figures_from_summary(run.summary or {})
    if figures:
        return figures, "summary"
    samples = [
        SampleRow(
            mode=s.mode,
            concurrency=s.concurrency,
            ok=s.ok,
            output_tokens=s.output_tokens,
            ttft_ms=s.ttft_ms,
            tpot_ms=s.tpot_ms,
            e2e_ms=s.e2e_ms,
            started_at=s.started_at,
        )
        for s in run.samples.all()
    ]
    figures = figures_from_samples(samples)
    return figures, "samples" if figures else ""


def latency_by_mode(run: BenchmarkRun) -> dict[str, list[float]]:
    """End-to-end latencies (ms) of the run's successful requests, per mode."""
    out: dict[str, list[float]] = {}
    rows = BenchmarkSample.objects.filter(run=run, ok=True, e2e_ms__isnull=False)
    for mode, e2e in rows.values_list("mode", "e2e_ms"):
        if e2e is not None:
            out.setdefault(mode, []).append(e2e)
    return out


def advice(
    goal: str, *, ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None
) -> tuple[Recommendation | None, str, int]:
    """The benchmarks app's mode advisor over the newest successful runs, as its API asks it:
    (recommendation, error, runs considered)."""
    summaries = benchmark_services.advisor_summaries()
    try:
        found = analysis.advise(summaries, goal, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
    except ValueError as exc:
        return None, str(exc), len(summaries)
    return found, "", len(summaries)


def benchmark_schedules() -> list[dict[str, Any]]:
    """The django-celery-beat rows that run scheduled benchmarks (edited in the admin)."""
    from django_celery_beat.models import PeriodicTask

    rows = []
    for task in PeriodicTask.objects.filter(task=TASK_NAME).select_related("interval", "crontab"):
        try:
            kwargs = json.loads(task.kwargs or "{}")
        except ValueError:
            kwargs = {}
        rows.append(
            {
                "task": task,
                "when": str(task.interval or task.crontab or task.clocked or task.solar or "-"),
                "kwargs": kwargs if isinstance(kwargs, dict) else {},
            }
        )
    return rows


def placement_problems(
    profile: DeploymentProfile, node: Node | None, node_selector: dict[str, str]
) -> list[PlacementError]:
    """Every reason a deployment of ``profile`` would not be placed, found without creating
    it: the profile against the named node, else the scheduler's choice within
    ``node_selector`` (what ``deployments.services.create_deployment`` asks)."""
    if node is not None:
        return check_placement(profile, node)
    try:
        choose(Deployment(profile=profile, pinned=False, node_selector=node_selector))
    except PlacementError as exc:
        return exc.problems
    return []


def policy_rollout(policy: SchedulingPolicy) -> dict[str, Any] | None:
    """Which registered routers report the policy's current version in their latest stats
    report: ``rows`` of (router, applied), those that have not (an older version, none yet)
    first, and ``applied``, how many have. Routers report the version of the default policy
    alone, so for another policy this is None."""
    if policy.name != "default":
        return None
    routers = list(RouterInstance.objects.all())
    rows = [(r, r.policy_version == policy.version) for r in routers]
    rows.sort(key=lambda row: row[1])  # stable: by name within each group
    return {"rows": rows, "applied": sum(applied for _, applied in rows)}


@dataclass(frozen=True)
class RunEstimate:
    """How long a run by concurrency levels takes: a level of c sends its requests c at a
    time, so it lasts about ceil(requests / c) requests one after another."""

    requests: int
    rounds: int
    seconds_per_request: float | None  # the mean end-to-end latency of a measured run
    measured_run: int | None

    @property
    def seconds(self) -> float | None:
        if self.seconds_per_request is None:
            return None
        return self.rounds * self.seconds_per_request


def run_estimate(
    scenario: Scenario,
    mode: str,
    concurrency: Sequence[int],
    iterations: int,
    warmup: int,
    request_rates: Sequence[float] = (),
) -> RunEstimate | None:
    """The run's requests and rounds, timed by the newest successful run of its scenario
    (that run's mean end-to-end latency in the same mode); None for a goodput sweep, whose
    length depends on what it measures."""
    if request_rates or not concurrency or iterations < 1:
        return None
    modes = len(BenchmarkMode) - 1 if mode == BenchmarkMode.ALL else 1  # all: each in turn
    per_mode = sum(math.ceil(iterations / c) + math.ceil(warmup / c) for c in concurrency)
    requests = modes * len(concurrency) * (iterations + warmup)
    measured = (
        BenchmarkRun.objects.filter(scenario=scenario, status=RunStatus.SUCCEEDED)
        .order_by("-finished_at")
        .first()
    )
    latencies: list[float] = []
    if measured is not None:
        figures, _ = run_figures(measured)
        same = [f for f in figures if mode in (f.mode, BenchmarkMode.ALL)] or figures
        latencies = [ms for f in same if (ms := f.e2e.get("mean")) is not None]
    return RunEstimate(
        requests=requests,
        rounds=modes * per_mode,
        seconds_per_request=sum(latencies) / len(latencies) / 1000.0 if latencies else None,
        measured_run=measured.pk if latencies and measured is not None else None,
    )
