from django.apps import AppConfig


class InventoryConfig(AppConfig):
    name = "controlplane.inventory"
    label = "inventory"
    default_auto_field = "django.db.models.BigAutoField"
