from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    name = "controlplane.benchmarks"
    label = "benchmarks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # lazy: models import only once the app registry is ready
        from controlplane.benchmarks.metrics import BenchmarksCollector
        from controlplane.core import metrics

        metrics.register(self.label, BenchmarksCollector())
