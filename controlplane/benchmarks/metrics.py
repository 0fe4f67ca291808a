"""The benchmarks' Prometheus families (registered in apps.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.benchmarks.models import BenchmarkRun

NEWEST_RUNS_READ = 500  # the newest finished runs scanned for each (deployment, scenario)


class BenchmarksCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        regression = GaugeMetricFamily(
            "syshax_benchmark_regression",
            "1 when the newest finished run of a deployment and scenario regressed.",
            labels=["deployment", "scenario"],
        )
        seen: set[tuple[int, int]] = set()
        finished = (
            BenchmarkRun.objects.filter(deployment__isnull=False, finished_at__isnull=False)
            .select_related("deployment", "scenario")
            .order_by("-finished_at")
        )
        for run in finished[:NEWEST_RUNS_READ]:
            key = (run.deployment_id or 0, run.scenario_id)
            if key in seen or run.deployment is None:
                continue
            seen.add(key)
            regression.add_metric([run.deployment.name, run.scenario.name], int(run.regression))
        yield regression
        yield CounterMetricFamily(
            "syshax_benchmark_regressions_total",
            "Runs flagged as regressions.",
            value=BenchmarkRun.objects.filter(regression=True).count(),
        )
