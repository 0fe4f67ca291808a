from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "controlplane.core"
    label = "core"
    default_auto_field = "django.db.models.BigAutoField"
