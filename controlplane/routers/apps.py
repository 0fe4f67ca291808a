from django.apps import AppConfig


class RoutersConfig(AppConfig):
    name = "controlplane.routers"
    label = "routers"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # lazy: models import only once the app registry is ready
        from controlplane.core import metrics
        from controlplane.routers.metrics import RoutersCollector

        metrics.register(self.label, RoutersCollector())
