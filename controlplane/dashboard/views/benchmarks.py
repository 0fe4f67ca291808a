from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlplane.benchmarks import analysis, services
from controlplane.benchmarks.choices import ACTIVE_STATUSES
from controlplane.benchmarks.models import BenchmarkRun
from controlplane.dashboard import benchdata, charts
from controlplane.dashboard import services as reads
from controlplane.dashboard.forms import BenchmarkRunForm
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
            messages.success(request, f"benchmark run {run.pk} started")
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


@login_required
def benchmark_detail(request: HttpRequest, pk: int) -> HttpResponse:
    run = get_object_or_404(BenchmarkRun.objects.select_related("scenario", "deployment"), pk=pk)
    context = chart_context(run)
    context["active"] = run.status in ACTIVE_STATUSES
    return render(request, "dashboard/benchmark_detail.html", context)


@login_required
def benchmark_charts(request: HttpRequest, pk: int) -> HttpResponse:
    """The charts section alone, swapped into the page when a watched run finishes."""
    run = get_object_or_404(BenchmarkRun.objects.select_related("scenario"), pk=pk)
    return render(request, "dashboard/_benchmark_charts.html", chart_context(run))


@login_required
def benchmark_progress(request: HttpRequest, pk: int) -> JsonResponse:
    run = get_object_or_404(BenchmarkRun, pk=pk)
    return JsonResponse(
        {
            "id": run.pk,
            "status": run.status,
            "progress": run.progress,
            "active": run.status in ACTIVE_STATUSES,
            "error": run.error,
        }
    )


@require_POST
@require_perm("benchmarks.change_benchmarkrun")
def benchmark_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    run = services.request_cancel(get_object_or_404(BenchmarkRun, pk=pk), acting_user=request.user)
    messages.info(request, f"run {run.pk} is {run.status}; cancel requested")
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
        columns.append((run, figures))
        for mode, points in benchdata.throughput_series(figures).items():
            series[f"#{run.pk} {mode}"] = points
    chart = charts.line_chart(
        series,
        title="Throughput against concurrency, runs compared",
        x_label="concurrency",
        y_label="output tokens/s",
    )
    choices = BenchmarkRun.objects.select_related("scenario")[:50]
    context = {"columns": columns, "chart": chart, "choices": choices, "selected": ids}
    return render(request, "dashboard/benchmark_compare.html", context)
