from __future__ import annotations

from django.contrib import admin

from controlplane.routers.models import RouterInstance, RouterStatsSample


@admin.register(RouterInstance)
class RouterInstanceAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "name",
        "version",
        "listen_url",
        "last_seen_at",
        "policy_version",
        "request_rate",
    ]
    search_fields = ["name", "listen_url"]
    readonly_fields = ["registered_at", "last_seen_at", "policy_version", "request_rate", "stats"]


@admin.register(RouterStatsSample)
class RouterStatsSampleAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["router", "received_at", "request_rate", "policy_version"]
    list_filter = ["router"]
