from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST
from django_celery_beat.models import PeriodicTask

from controlplane.benchmarks import analysis, schedules, services
from controlplane.benchmarks.choices import ACTIVE_STATUSES, RunStatus
from controlplane.benchmarks.models import BenchmarkRun
from controlplane.dashboard import benchdata, charts
from controlplane.dashboard import services as reads
from controlplane.dashboard.benchmark_forms import ScheduleForm
from controlplane.dashboard.forms import DEFAULT_ITERATIONS, DEFAULT_LEVELS, BenchmarkRunForm
from controlplane.dashboard.views.common import require_perm
from loadgen.goodput import GoodputSearch

COMPARE_LIMIT = 4


def _float_param(request: HttpRequest, name: str) -> float | None:
    try:
        value = float(request.GET.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def advisor_context(request: HttpRequest) -> dict[str, Any]:
    """The mode advisor for the goal the operator picked (throughput unless told)."""
    goal = request.GET.get("goal", "throughput")
    if goal not in analysis.GOALS:
        goal = "throughput"
    ttft, tpot = _float_param(request, "ttft_slo_ms"), _float_param(request, "tpot_slo_ms")
    recommendation, error, considered = reads.advice(goal, ttft_slo_ms=ttft, tpot_slo_ms=tpot)
    return {
        "goal": goal,
        "goals": analysis.GOALS,
        "ttft_slo_ms": ttft,
        "tpot_slo_ms": tpot,
        "recommendation": recommendation,
        "error": error,
        "considered": considered,
    }


def form_context(form: BenchmarkRunForm) -> dict[str, Any]:
    """The start form and how long the run it describes would take."""
    fields = form.estimate_fields()
    return {"form": form, "estimate": reads.run_estimate(**fields) if fields else None}


@login_required
def benchmark_list(request: HttpRequest) -> HttpResponse:
    runs = BenchmarkRun.objects.select_related("scenario", "deployment")[:50]
    context = {
        "runs": runs,
        **form_context(BenchmarkRunForm(initial={"scenario": "short"})),
        "advisor": advisor_context(request),
        "schedules": reads.benchmark_schedules(),
        "schedule_defaults": f"concurrency {DEFAULT_LEVELS} x {DEFAULT_ITERATIONS} iterations",
    }
    return render(request, "dashboard/benchmark_list.html", context)


@require_perm("benchmarks.add_benchmarkrun")
def benchmark_create(request: HttpRequest) -> HttpResponse:
    form = BenchmarkRunForm(request.POST or None, initial={"scenario": "short"})
    if form.is_bound:
        # The target and the run's own rules are judged with the form, all in one round.
        unread = set(form.errors)  # the form converts its fields first
        form.add_model_errors(services.run_errors(exclude=unread, **form.run_fields()))
    if request.method == "POST" and form.is_valid():
        try:
            run = services.create_run(acting_user=request.user, **form.run_fields())
        except ValidationError as exc:
            form.add_model_errors(exc.message_dict)
        else:
            # No message: the run's page says where the run is, from its one state.
            return redirect("dashboard:benchmark", pk=run.pk)
    status = 400 if request.method == "POST" else 200
    return render(request, "dashboard/benchmark_form.html", form_context(form), status=status)


def sweep_context(run: BenchmarkRun) -> dict[str, Any]:
    """A goodput sweep's charts (attainment and goodput against rate, per mode) and each
    mode's max goodput; empty for a run by concurrency levels."""
    stored = run.summary.get("sweeps") if isinstance(run.summary, dict) else None
    if not isinstance(stored, dict):
        stored = {}
    searches: dict[str, GoodputSearch] = {}
    for mode, data in stored.items():
        try:
            searches[mode] = GoodputSearch.from_dict(dict(data))
        except (KeyError, TypeError, ValueError):
            continue
    if not searches:
        return {"sweeps": []}
    return {
        "sweeps": [
            (mode, search.max_goodput_rate, search.verdict()) for mode, search in searches.items()
        ],
        "attainment_chart": charts.line_chart(
            {m: [(p.rate, p.attainment) for p in s.points] for m, s in searches.items()},
            title=f"SLO attainment against request rate per mode, run {run.pk}",
            x_label="request rate (req/s)",
            y_label="SLO attainment (%)",
        ),
        "goodput_chart": charts.line_chart(
            {m: [(p.rate, p.goodput) for p in s.points] for m, s in searches.items()},
            title=f"Goodput against request rate per mode, run {run.pk}",
            x_label="request rate (req/s)",
            y_label="goodput (req/s)",
        ),
    }


def chart_context(run: BenchmarkRun) -> dict[str, Any]:
    """The charts of one run; empty charts are left out and the template says why."""
    figures, source = reads.run_figures(run)
    sweep = sweep_context(run)
    if sweep["sweeps"]:
        # Every row of a sweep has the same concurrency cap: the sweep charts replace the
        # charts against concurrency.
        return {"run": run, "figures": figures, "source": source, "level": None, **sweep}
    level = max((f.concurrency for f in figures), default=None)
    latencies = reads.latency_by_mode(run)
    return {
        "run": run,
        "figures": figures,
        "source": source,
        "level": level,
        "throughput_chart": charts.line_chart(
            benchdata.throughput_series(figures),
            title=f"Throughput against concurrency per mode, run {run.pk}",
            x_label="concurrency",
            y_label="output tokens/s",
        ),
        "ttft_chart": charts.grouped_bar_chart(
            list(benchdata.PERCENTILES),
            benchdata.percentile_series(figures, "ttft", level),
            title=f"Time to first token percentiles at concurrency {level}, run {run.pk}",
            y_label="TTFT (ms)",
        ),
        "tpot_chart": charts.grouped_bar_chart(
            list(benchdata.PERCENTILES),
            benchdata.percentile_series(figures, "tpot", level),
            title=f"Time per output token percentiles at concurrency {level}, run {run.pk}",
            y_label="TPOT (ms)",
        ),
        "histograms": [
            (
                mode,
                charts.histogram(
                    values,
                    title=f"End-to-end latency histogram, {mode} mode, run {run.pk}",
                    x_label="end-to-end latency (ms)",
                    name=mode,
                ),
            )
            for mode, values in sorted(latencies.items())
        ],
        **sweep,
    }


def run_state(run: BenchmarkRun) -> dict[str, Any]:
    """Where the run is, for its page and its progress JSON alike: every part of the page
    (banner, badge, Cancel button, charts) derives from this one state."""
    eta = None
    if run.status == RunStatus.RUNNING and run.eta_at is not None:
        eta = max((run.eta_at - timezone.now()).total_seconds(), 0.0)
    state = run.state
    return {
        "id": run.pk,
        "status": run.status,
        "state": state,
        "active": run.status in ACTIVE_STATUSES,
        "cancellable": run.cancellable,
        "progress": run.progress,
        "percent": f"{run.progress * 100:.1f}%",
        "phase": run.phase,
        "points_done": run.points_done,
        "points_total": run.points_total,
        "eta_seconds": eta,
        "eta": benchdata.eta_text(eta),
        "banner": benchdata.run_banner(
            run.pk, state, run.phase, run.points_done, run.points_total, eta
        ),
        "partial": run.partial,
        "error": run.error,
    }


@login_required
def benchmark_detail(request: HttpRequest, pk: int) -> HttpResponse:
    run = get_object_or_404(BenchmarkRun.objects.select_related("scenario", "deployment"), pk=pk)
    context = chart_context(run)
    context["active"] = run.status in ACTIVE_STATUSES
    context["state"] = run_state(run)
    context["recorded"] = benchdata.recorded_facts(run.recorded_under)
    return render(request, "dashboard/benchmark_detail.html", context)


@login_required
def benchmark_charts(request: HttpRequest, pk: int) -> HttpResponse:
    """The charts section alone, swapped into the page as a run's points arrive."""
    run = get_object_or_404(BenchmarkRun.objects.select_related("scenario"), pk=pk)
    return render(request, "dashboard/_benchmark_charts.html", chart_context(run))


@login_required
def benchmark_progress(request: HttpRequest, pk: int) -> JsonResponse:
    return JsonResponse(run_state(get_object_or_404(BenchmarkRun, pk=pk)))


@require_POST
@require_perm("benchmarks.change_benchmarkrun")
def benchmark_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """Cancel; a page's script gets the run's new state as JSON, a plain form the page
    again (which shows "cancelling", then "cancelled", from the same state)."""
    run = services.request_cancel(get_object_or_404(BenchmarkRun, pk=pk), acting_user=request.user)
    if "application/json" in request.headers.get("Accept", ""):
        return JsonResponse(run_state(run))
    return redirect("dashboard:benchmark", pk=pk)


@login_required
def benchmark_compare(request: HttpRequest) -> HttpResponse:
    """Runs side by side: one throughput chart and one table row per run, mode and level."""
    ids = [int(x) for x in request.GET.getlist("run") if x.isdigit()][:COMPARE_LIMIT]
    runs = list(BenchmarkRun.objects.filter(pk__in=ids).select_related("scenario"))
    columns = []
    series: dict[str, list[tuple[float, float]]] = {}
    for run in sorted(runs, key=lambda r: ids.index(r.pk)):
        figures, _ = reads.run_figures(run)
        columns.append((run, figures, benchdata.recorded_facts(run.recorded_under)))
        for mode, points in benchdata.throughput_series(figures).items():
            series[f"#{run.pk} {mode}"] = points
    chart = charts.line_chart(
        series,
        title="Throughput against concurrency, runs compared",
        x_label="concurrency",
        y_label="output tokens/s",
    )
    choices = BenchmarkRun.objects.select_related("scenario")[:50]
    policies = {benchdata.policy_label(run.recorded_under) for run, _, _ in columns}
    context = {
        "columns": columns,
        "chart": chart,
        "choices": choices,
        "selected": ids,
        # Runs under different policy revisions do not compare like for like: say so.
        "mixed_policies": sorted(p or "unrecorded" for p in policies) if len(policies) > 1 else [],
    }
    return render(request, "dashboard/benchmark_compare.html", context)


def _schedule_page(
    request: HttpRequest, form: ScheduleForm, task: PeriodicTask | None
) -> HttpResponse:
    if form.is_bound:
        form.is_valid()
        problems = schedules.schedule_problems(form.submitted(), task)
        form.add_problems(problems)
        if not form.errors:
            try:
                saved = schedules.save_schedule(
                    form.submitted(), task=task, acting_user=request.user
                )
            except ValidationError as exc:
                form.add_problems({k: v[0] for k, v in exc.message_dict.items()})
            else:
                state = "saved" if saved.enabled else "saved, disabled"
                messages.success(request, f"schedule {saved.name!r} {state}")
                return redirect(f"{reverse('dashboard:benchmarks')}#schedules")
    status = 400 if form.is_bound else 200
    context = {"form": form, "task": task}
    return render(request, "dashboard/benchmark_schedule_form.html", context, status=status)


@require_perm("django_celery_beat.add_periodictask")
def schedule_create(request: HttpRequest) -> HttpResponse:
    """A new scheduled benchmark (a django-celery-beat periodic task), every error at once."""
    return _schedule_page(request, ScheduleForm(request.POST or None), None)


@require_perm("django_celery_beat.change_periodictask")
def schedule_edit(request: HttpRequest, pk: int) -> HttpResponse:
    """Change or disable a scheduled benchmark."""
    task = get_object_or_404(PeriodicTask, pk=pk, task=schedules.TASK_NAME)
    data = request.POST if request.method == "POST" else None
    return _schedule_page(request, ScheduleForm.for_task(task, data), task)
