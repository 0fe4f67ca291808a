from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    name = "controlplane.benchmarks"
    label = "benchmarks"
    default_auto_field = "django.db.models.BigAutoField"
