from django.apps import AppConfig


class AccessConfig(AppConfig):
    name = "controlplane.access"
    label = "access"
    default_auto_field = "django.db.models.BigAutoField"
