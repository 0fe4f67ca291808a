from django.apps import AppConfig


class InventoryConfig(AppConfig):
    name = "controlplane.inventory"
    label = "inventory"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # lazy: models import only once the app registry is ready
        from controlplane.core import metrics
        from controlplane.inventory.metrics import InventoryCollector

        metrics.register(self.label, InventoryCollector())
