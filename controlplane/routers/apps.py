from django.apps import AppConfig


class RoutersConfig(AppConfig):
    name = "controlplane.routers"
    label = "routers"
    default_auto_field = "django.db.models.BigAutoField"
