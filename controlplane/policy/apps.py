from django.apps import AppConfig


class PolicyConfig(AppConfig):
    name = "controlplane.policy"
    label = "policy"
    default_auto_field = "django.db.models.BigAutoField"
