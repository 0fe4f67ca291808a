"""Execute a BenchmarkRun: claim it, measure, store the summary and every request's sample.

The row is the source of truth. ``claim`` moves it queued -> running with a compare-and-set,
so a redelivered task finds it taken and does nothing. Failed requests are stored with
their errors; a run that raises keeps the rows measured so far.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone

from controlplane.benchmarks.choices import RUN_LIFECYCLE, RunStatus
from controlplane.benchmarks.measure import Cancelled, Plan, measure
from controlplane.benchmarks.models import BenchmarkRun, BenchmarkSample
from controlplane.benchmarks.services import _endpoint, flag_regression
from controlplane.inventory.models import Heartbeat
from controlplane.routers.models import RouterInstance
from loadgen.controlplane import summarize_heartbeats
from loadgen.goodput import DEFAULT_BISECTIONS, GoodputSearch
from loadgen.report import to_json
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
    """The run's own URL, or a live router for a deployment's run (modes are forced per
    request, so the three modes run on the same engines)."""
    if run.target_url:
        return run.target_url
    routers = [r for r in RouterInstance.objects.order_by("-last_seen_at") if r.is_alive]
    for router in routers:
        if router.listen_url:
            return router.listen_url
    raise RunError(
        f"no live router to reach deployment {run.deployment}; start one or give target_url"
    )


def router_api_key(url: str) -> str:
    """The routers' benchmark key (``ROUTER_BENCHMARK_KEY``, which may force each mode; else
    ``ROUTER_API_KEY``) when ``url`` is a registered router's, else nothing: a key is never
    sent to an engine or an allowed outside target."""
    key = str(settings.ROUTER_BENCHMARK_KEY or settings.ROUTER_API_KEY)
    listening = RouterInstance.objects.exclude(listen_url="").values_list("listen_url", flat=True)
    endpoint = _endpoint(url)
    if key and endpoint is not None and endpoint in {_endpoint(u) for u in listening}:
        return key
    return ""


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


def _finish(run_id: int, status: str, **fields: Any) -> None:
    """The run ends, from a state its table lets end so (a finished run stays finished)."""
    BenchmarkRun.objects.filter(pk=run_id, status__in=RUN_LIFECYCLE.sources(status)).update(
        status=status, finished_at=timezone.now(), **fields
    )


def execute(run_id: int) -> str:

    if not claim(run_id):
        return BenchmarkRun.objects.get(pk=run_id).status
    run = BenchmarkRun.objects.select_related("scenario", "deployment").get(pk=run_id)
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
        _finish(run_id, RunStatus.FAILED, error=str(exc))
        return RunStatus.FAILED

    @sync_to_async
    def report(done: int, total: int) -> bool:
        BenchmarkRun.objects.filter(pk=run_id).update(progress=done / total if total else 1.0)
        return not BenchmarkRun.objects.filter(pk=run_id, cancel_requested=True).exists()

    started = timezone.now()
    sweeps: dict[str, GoodputSearch] = {}

    async def measure_then_close() -> list[Any]:
        try:
            return await measure(plan, report, sweeps=sweeps)
        finally:
            # report() ran in asgiref's shared thread, which keeps its own connection open;
            # close it so a long-lived worker holds none between runs.
            await sync_to_async(connections.close_all)()

    try:
        rows = asyncio.run(measure_then_close())
    except Cancelled:
        _finish(run_id, RunStatus.CANCELLED, error="cancelled by request")
        return RunStatus.CANCELLED
    except Exception as exc:
        log.exception("benchmark run %s failed", run_id)
        _finish(run_id, RunStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        return RunStatus.FAILED
    config = {
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
    if run.deployment is not None:
        attach_resources(rows, run.deployment.node_id)
    if sweep is not None:
        config["request_rates"] = list(sweep.rates)
        config["slo_ms"] = {"ttft": run.slo_ttft_ms, "tpot": run.slo_tpot_ms}
        config["slo_attainment"] = run.slo_attainment
    summary = to_json(config, rows, samples=False)
    if sweeps:
        summary["sweeps"] = {mode: search.to_dict() for mode, search in sweeps.items()}
    sent = [record.sent_at for row in rows for record in row.records if record.sent_at]
    origin = min(sent) if sent else 0.0
    with transaction.atomic():
        BenchmarkSample.objects.filter(run_id=run_id).delete()
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
        failed = sum(row.summary.failed for row in rows)
        _finish(
            run_id,
            RunStatus.SUCCEEDED,
            summary=summary,
            progress=1.0,
            error=f"{failed} request(s) failed; see the samples" if failed else "",
        )
    run.refresh_from_db()
    if run.regression_threshold_percent is not None:
        flag_regression(run, run.regression_threshold_percent)
    return RunStatus.SUCCEEDED
