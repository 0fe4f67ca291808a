from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "controlplane.deployments"
    label = "deployments"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # lazy: models import only once the app registry is ready
        from controlplane.core import metrics
        from controlplane.deployments import receivers
        from controlplane.deployments.metrics import DeploymentsCollector
        from controlplane.inventory import signals

        metrics.register(self.label, DeploymentsCollector())
        signals.node_lost.connect(receivers.on_node_lost, dispatch_uid="deployments-node-lost")
        signals.node_returned.connect(
            receivers.on_node_returned, dispatch_uid="deployments-node-returned"
        )
