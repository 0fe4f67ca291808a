"""Queue a Celery task by name, once the current transaction commits.

Services sit below their app's ``tasks.py`` (entry points only, docs/architecture.md), so they
name the task they queue instead of importing it. The task is looked up in the app's registry
(``task_always_eager`` still applies, unlike ``send_task``); the first lookup in a process
imports every app's ``tasks`` module, as a worker does when it starts.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from celery.app.task import Task
from django.db import transaction


def load_tasks() -> None:
    """Import every app's ``tasks`` module, as a worker does when it starts."""
    current_app.loader.import_default_modules()


def task(name: str) -> Task[Any, Any]:
    found = current_app.tasks.get(name)
    if found is None:
        load_tasks()
        found = current_app.tasks[name]  # KeyError names a task that does not exist
    return found


def enqueue(name: str, *args: Any) -> None:
    """``name``'s ``delay(*args)`` after commit (at once outside a transaction); a rolled-back
    change queues nothing."""
    transaction.on_commit(lambda: task(name).delay(*args))
