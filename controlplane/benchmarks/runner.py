"""Execute a BenchmarkRun: claim it, measure, store the summary and every request's sample.

The row is the source of truth. ``claim`` moves it queued -> running with a compare-and-set,
so a redelivered task finds it taken and does nothing. The run reports as it goes: its
phase when a point starts, and each point's samples, a partial summary and an ETA as soon
as the point finishes. A cancelled or failed run keeps the points it finished (its summary
says "partial"); failed requests are stored with their errors.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.forms.models import model_to_dict
from django.utils import timezone

from controlplane.benchmarks.choices import RUN_LIFECYCLE, RunStatus
from controlplane.benchmarks.measure import Cancelled, Hooks, Plan, Point, measure
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample
from controlplane.benchmarks.services import flag_regression
from controlplane.deployments.models import DeploymentProfile
from controlplane.inventory.models import Heartbeat
from controlplane.policy.models import SchedulingPolicy
from controlplane.routers import destinations
from loadgen.controlplane import summarize_heartbeats
from loadgen.goodput import DEFAULT_BISECTIONS, GoodputSearch
from loadgen.report import Row, to_json
from loadgen.stats import SLO
from loadgen.sweeping import SweepPlan

log = logging.getLogger(__name__)


class RunError(Exception):
    pass


def claim(run_id: int) -> bool:
    """Compare-and-set queued -> running; a redelivered task finds it taken and stops."""
    return bool(
        BenchmarkRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
            status=RunStatus.RUNNING, started_at=timezone.now()
        )
    )


def target_url(run: BenchmarkRun) -> str:
    """The run's own URL, or a configured router for a deployment's run (modes are forced per
    request, so the three modes run on the same engines); never an address a router only
    reported (``controlplane.routers.destinations``)."""
    if run.target_url:
        return run.target_url
    destination = destinations.pick()
    if destination is not None:
        return destination.url
    raise RunError(
        f"no router configured to reach deployment {run.deployment}: list the routers in "
        "ROUTER_URLS, or give target_url"
    )


def router_api_key(url: str) -> str:
    """The routers' benchmark key (``ROUTER_BENCHMARK_KEY``, which may force each mode; else
    ``ROUTER_API_KEY``) when ``url`` is a configured router's (``ROUTER_URLS``), else
    nothing: a key is never sent to an engine, an allowed outside target or an address a
    router only reported."""
    return destinations.router_key_for(url)


def attach_resources(rows: list[Any], node_id: int) -> None:
    """The node's CPU, memory and accelerator use during each row, from its heartbeats."""
    from datetime import UTC, datetime

    for row in rows:
        if not row.window:
            continue
        start, end = (datetime.fromtimestamp(t, tz=UTC) for t in row.window)
        beats = Heartbeat.objects.filter(node_id=node_id, received_at__range=(start, end))
        row.resources = summarize_heartbeats(
            [dict(b) for b in beats.values("cpu_percent", "memory_used_bytes", "accelerators")]
        )


def _finish(run_id: int, status: str, **fields: Any) -> bool:
    """The run ends, from a state its table lets end so (a finished run stays finished)."""
    return bool(
        BenchmarkRun.objects.filter(pk=run_id, status__in=RUN_LIFECYCLE.sources(status)).update(
            status=status, finished_at=timezone.now(), eta_at=None, **fields
        )
    )


def _running(run_id: int) -> Any:
    """The run's row while it is still this worker's to write (running): a write through it
    never lands on a run that was cancelled or finished meanwhile."""
    return BenchmarkRun.objects.filter(pk=run_id, status=RunStatus.RUNNING)


def profile_fingerprint(profile: DeploymentProfile) -> str:
    """A short hash of every setting of the profile: two runs with the same fingerprint ran
    the same engine settings."""
    values = model_to_dict(profile, exclude=["id"])
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_policy(run: BenchmarkRun) -> SchedulingPolicy | None:
    """The policy the run's router applies: its deployment's, else the default one (which
    every router applies; a run against a bare URL gets it too)."""
    if run.deployment is not None and run.deployment.policy_id is not None:
        return SchedulingPolicy.objects.filter(pk=run.deployment.policy_id).first()
    return SchedulingPolicy.objects.filter(name="default").first()


def recorded_under(run: BenchmarkRun) -> dict[str, Any]:
    """What the run runs under, read when it starts: the policy and its version, the
    profile and its fingerprint, and the engines (kind, images, the node's agent version;
    the engines do not report their own vLLM version)."""
    found: dict[str, Any] = {}
    policy = run_policy(run)
    if policy is not None:
        found["policy"] = {
            "name": policy.name,
            "version": policy.version,
            "versions_seen": [policy.version],
        }
    deployment = run.deployment
    if deployment is None:
        found["engines"] = {"target": run.target_url}
        return found
    profile = deployment.profile
    found["profile"] = {
        "name": profile.name,
        "fingerprint": profile_fingerprint(profile),
        "updated_at": profile.updated_at.isoformat() if profile.updated_at else None,
    }
    engines: dict[str, Any] = {"kind": profile.engine, "gpu_image": profile.gpu_image}
    if profile.enable_cpu_engine:
        engines["cpu_image"] = profile.cpu_image
    if profile.engine == "simulator":
        engines["sim_devices"] = [profile.sim_gpu_device, profile.sim_cpu_device]
    if deployment.node.agent_version:
        engines["agent_version"] = deployment.node.agent_version
    engines["generation"] = deployment.generation
    found["engines"] = engines
    return found


def note_policy_version(run_id: int, under: dict[str, Any]) -> None:
    """Add the policy's current version to the versions the run has seen (a change made
    while it ran)."""
    policy = under.get("policy")
    if not policy:
        return
    version = (
        SchedulingPolicy.objects.filter(name=policy["name"])
        .values_list("version", flat=True)
        .first()
    )
    if version is not None and version not in policy["versions_seen"]:
        policy["versions_seen"].append(version)
        _running(run_id).update(recorded_under=under)


class Progress:
    """The run's progress as it goes, written to its row: the phase when a point starts;
    the point's samples, a partial summary, the points done and an ETA when it ends.

    The ETA comes from the measured seconds per round (a level of c sends its requests c at
    a time, so it lasts about ceil(requests / c) rounds): the rounds still to go at the mean
    round time of the points done so far."""

    def __init__(
        self, run: BenchmarkRun, plan: Plan, config: dict[str, Any], under: dict[str, Any]
    ) -> None:
        self.run_id = run.pk
        self.plan = plan
        self.config = config
        self.under = under
        self.rows: list[Row] = []
        self.origin: float | None = None
        self.points_total = plan.points_total
        self.point_started_at = timezone.now()
        self.measured_s = 0.0  # seconds of the finished points
        self.rounds_done = 0
        self.current: Point | None = None
        self.node_id = run.deployment.node_id if run.deployment is not None else None

    def rounds(self, concurrency: int) -> int:
        if self.plan.sweep is not None:
            return 1  # a sweep's points last about as long as each other
        per = max(concurrency, 1)
        return math.ceil(self.plan.iterations / per) + math.ceil(self.plan.warmup / per)

    def rounds_left(self) -> int:
        if self.plan.sweep is not None:
            return max(self.points_total - len(self.rows), 0)
        modes = len(self.plan.targets())
        total = modes * sum(self.rounds(level) for level in self.plan.levels)
        return max(total - self.rounds_done, 0)

    def eta(self) -> Any:
        if not self.rows or self.rounds_done == 0:
            return None
        per_round = self.measured_s / self.rounds_done
        left = self.rounds_left() * per_round
        if self.current is not None:
            left -= (timezone.now() - self.point_started_at).total_seconds()
        return timezone.now() + timedelta(seconds=max(left, 0.0))

    def started(self, point: Point) -> None:
        self.current = point
        self.point_started_at = timezone.now()
        self.points_total = max(self.points_total, point.total)
        phase = point.label
        if point.warmup:
            phase = f"warm-up, {phase}"
        _running(self.run_id).update(phase=phase, points_total=self.points_total)

    def finished(self, row: Row) -> None:
        seconds = (timezone.now() - self.point_started_at).total_seconds()
        self.measured_s += seconds
        self.rounds_done += self.rounds(row.concurrency)
        self.current = None
        self.rows.append(row)
        sent = [record.sent_at for record in row.records if record.sent_at]
        if self.origin is None and sent:
            self.origin = min(sent)
        origin = self.origin or 0.0
        if self.node_id is not None:
            attach_resources([row], self.node_id)
        note_policy_version(self.run_id, self.under)
        summary = self.summary(partial=True)
        done = len(self.rows)
        with transaction.atomic():
            updated = _running(self.run_id).update(
                summary=summary,
                points_done=done,
                points_total=max(self.points_total, done),
                eta_at=self.eta(),
                phase=f"{done} of {max(self.points_total, done)} points measured",
            )
            if updated:
                store_samples(self.run_id, [row], origin)

    def summary(self, *, partial: bool) -> dict[str, Any]:
        summary = to_json({**self.config, "recorded_under": self.under}, self.rows, samples=False)
        if partial:
            summary["partial"] = True
            summary["points"] = {"done": len(self.rows), "total": self.points_total}
        return summary

    def ended_label(self, how: str) -> str:
        total = max(self.points_total, len(self.rows))
        return f"{how} after {len(self.rows)} of {total} points"


def store_samples(run_id: int, rows: list[Row], origin: float) -> None:
    BenchmarkSample.objects.bulk_create(
        BenchmarkSample(
            run_id=run_id,
            mode=row.mode,
            concurrency=row.concurrency,
            request_rate=row.rate or 0.0,
            index=position,
            ok=record.ok,
            error=record.error or "",
            prompt_tokens=record.prompt_tokens,
            output_tokens=record.output_tokens,
            ttft_ms=None if record.ttft is None else record.ttft * 1000,
            tpot_ms=None if record.tpot is None else record.tpot * 1000,
            e2e_ms=None if record.latency is None else record.latency * 1000,
            started_at=max(0.0, record.sent_at - origin),
        )
        for row in rows
        for position, record in enumerate(row.records)
    )


Measure = Callable[..., Coroutine[Any, Any, list[Row]]]


def execute(run_id: int, measure_with: Measure = measure) -> str:
    """Claim the run and measure it; ``measure_with`` stands in for the load generator in
    tests (it gets the plan and the hooks, as :func:`measure.measure` does)."""
    if not claim(run_id):
        return BenchmarkRun.objects.get(pk=run_id).status
    run = BenchmarkRun.objects.select_related(
        "scenario", "deployment__profile", "deployment__node"
    ).get(pk=run_id)
    under = recorded_under(run)
    try:
        url = target_url(run)
        sweep = None
        if run.request_rates:
            sweep = SweepPlan(
                rates=tuple(float(rate) for rate in run.request_rates),
                slo=SLO(run.slo_ttft_ms, run.slo_tpot_ms),
                iterations=run.iterations,
                input_tokens=run.scenario.input_tokens,
                output_tokens=run.scenario.output_tokens,
                attainment=run.slo_attainment,
                bisections=DEFAULT_BISECTIONS if run.find_max_goodput else 0,
                warmup=run.warmup,
                seed=run.seed,
            )
        plan = Plan(
            url=url,
            mode=run.mode,
            levels=list(run.concurrency),
            iterations=run.iterations,
            warmup=run.warmup,
            seed=run.seed,
            input_tokens=run.scenario.input_tokens,
            output_tokens=run.scenario.output_tokens,
            api_key=router_api_key(url),
            sweep=sweep,
        )
    except (RunError, ValueError) as exc:
        _finish(run_id, RunStatus.FAILED, error=str(exc), recorded_under=under)
        return RunStatus.FAILED

    started = timezone.now()
    config: dict[str, Any] = {
        "run": run_id,
        "scenario": {
            "name": run.scenario.name,
            "input_tokens": plan.input_tokens,
            "output_tokens": plan.output_tokens,
        },
        "target": plan.url,
        "mode": run.mode,
        "concurrency": plan.levels,
        "iterations": plan.iterations,
        "warmup": plan.warmup,
        "seed": plan.seed,
        "started_at": started.isoformat(),
    }
    if sweep is not None:
        config["request_rates"] = list(sweep.rates)
        config["slo_ms"] = {"ttft": run.slo_ttft_ms, "tpot": run.slo_tpot_ms}
        config["slo_attainment"] = run.slo_attainment
    progress = Progress(run, plan, config, under)
    _running(run_id).update(
        recorded_under=under,
        points_total=plan.points_total,
        points_done=0,
        phase="connecting to the target",
    )

    @sync_to_async
    def report(done: int, total: int) -> bool:
        BenchmarkRun.objects.filter(pk=run_id).update(progress=done / total if total else 1.0)
        return not BenchmarkRun.objects.filter(pk=run_id, cancel_requested=True).exists()

    hooks = Hooks(
        report=report,
        started=sync_to_async(progress.started),
        finished=sync_to_async(progress.finished),
    )
    sweeps: dict[str, GoodputSearch] = {}

    async def measure_then_close() -> list[Any]:
        try:
            return await measure_with(plan, hooks, sweeps=sweeps)
        finally:
            # The hooks ran in asgiref's shared thread, which keeps its own connection open;
            # close it so a long-lived worker holds none between runs.
            await sync_to_async(connections.close_all)()

    try:
        rows = asyncio.run(measure_then_close())
    except Cancelled:
        _finish(
            run_id,
            RunStatus.CANCELLED,
            phase=progress.ended_label("cancelled"),
            error="",
            **({"summary": progress.summary(partial=True)} if progress.rows else {}),
        )
        return RunStatus.CANCELLED
    except Exception as exc:
        log.exception("benchmark run %s failed", run_id)
        _finish(
            run_id,
            RunStatus.FAILED,
            phase=progress.ended_label("failed"),
            error=f"{type(exc).__name__}: {exc}",
            **({"summary": progress.summary(partial=True)} if progress.rows else {}),
        )
        return RunStatus.FAILED
    # Every row was stored as it finished; a row the hooks did not see (none, normally) is
    # stored now, and the summary is the whole run's.
    seen = {id(row) for row in progress.rows}
    rest = [row for row in rows if id(row) not in seen]
    if run.deployment is not None:
        attach_resources(rest, run.deployment.node_id)
    progress.rows.extend(rest)
    note_policy_version(run_id, under)
    summary = progress.summary(partial=False)
    if sweeps:
        summary["sweeps"] = {mode: search.to_dict() for mode, search in sweeps.items()}
    failed = sum(row.summary.failed for row in progress.rows)
    done = len(progress.rows)
    with transaction.atomic():
        finished = _finish(
            run_id,
            RunStatus.SUCCEEDED,
            summary=summary,
            progress=1.0,
            points_done=done,
            points_total=done,
            phase=f"finished: {done} of {done} points",
            recorded_under=under,
            error=f"{failed} request(s) failed; see the samples" if failed else "",
        )
        if finished and rest:
            sent = [r.sent_at for row in rest for r in row.records if r.sent_at]
            store_samples(run_id, rest, progress.origin or (min(sent) if sent else 0.0))
    run.refresh_from_db()
    if run.status != RunStatus.SUCCEEDED:
        return str(run.status)
    if run.regression_threshold_percent is not None:
        flag_regression(run, run.regression_threshold_percent)
    return RunStatus.SUCCEEDED
