from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "controlplane.batches"
    label = "batches"
    verbose_name = "batches"
    default_auto_field = "django.db.models.BigAutoField"
