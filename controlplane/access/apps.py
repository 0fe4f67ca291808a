from django.apps import AppConfig


class AccessConfig(AppConfig):
    name = "controlplane.access"
    label = "access"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from controlplane.access import schema  # noqa: F401  (registers the OpenAPI scheme)
