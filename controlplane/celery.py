"""The control plane's Celery app. Workers run ``syshax worker``; beat runs ``syshax beat``."""

from __future__ import annotations

import os

from celery import Celery

import controlplane.core.broker  # noqa: F401 - registers the embedded broker's syshaxfs:// scheme

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
