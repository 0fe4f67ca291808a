from django.apps import AppConfig


class AccessConfig(AppConfig):
    name = "controlplane.access"
    label = "access"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # lazy: the OpenAPI scheme registers once DRF and the app registry are ready
        from controlplane.access import schema  # noqa: F401
