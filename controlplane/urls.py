from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("controlplane.api_urls")),
    # OpenAI's Batch API, where the official client looks for it (docs/batches.md).
    path("v1/", include("controlplane.batches.urls")),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("controlplane.dashboard.urls")),
]
