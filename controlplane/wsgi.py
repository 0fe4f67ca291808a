import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
application = get_wsgi_application()


def _warm() -> None:
    """Load now what a worker's first requests would load while answering them: the URLconf
    (every view and serializer) and every app's Celery task modules, which the first request
    that queues a task imports (``core/dispatch.py``). Those imports cost a worker about a
    second of CPU, once; paid in the middle of a deploy, they delayed it and every request
    the worker held meanwhile (docs/decisions/0036-group-commits-one-statement.md)."""
    # lazy: Django is set up by get_wsgi_application() above, not at this module's top
    from django.urls import get_resolver

    from controlplane.core.dispatch import load_tasks

    get_resolver().url_patterns  # noqa: B018  (the attribute imports the URLconf)
    load_tasks()


_warm()
