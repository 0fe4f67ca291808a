from django.apps import AppConfig


class PolicyConfig(AppConfig):
    name = "controlplane.policy"
    label = "policy"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # lazy: models import only once the app registry is ready
        from controlplane.core import metrics
        from controlplane.policy.metrics import PolicyCollector

        metrics.register(self.label, PolicyCollector())
