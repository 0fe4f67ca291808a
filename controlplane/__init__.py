"""The syshax control plane: a Django project with one app per concept."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
