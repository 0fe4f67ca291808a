"""Start Django for commands that use the control plane's ORM directly."""

from __future__ import annotations

import os


def setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    import django

    django.setup()
