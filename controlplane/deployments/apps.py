from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "controlplane.deployments"
    label = "deployments"
    default_auto_field = "django.db.models.BigAutoField"
