from __future__ import annotations

from django.contrib import admin

from controlplane.routers import destinations
from controlplane.routers.models import RouterInstance, RouterStatsSample


@admin.register(RouterInstance)
class RouterInstanceAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "name",
        "version",
        "listen_url",
        "listen_url_configured",
        "last_seen_at",
        "policy_version",
        "request_rate",
    ]
    search_fields = ["name", "listen_url"]
    readonly_fields = [
        "listen_url_configured",
        "registered_at",
        "last_seen_at",
        "policy_version",
        "request_rate",
        "stats",
    ]

    @admin.display(boolean=True, description="configured (ROUTER_URLS)")
    def listen_url_configured(self, router: RouterInstance) -> bool:
        """A reported address not in ROUTER_URLS is shown but never sent anything."""
        return destinations.is_configured(router.listen_url)


@admin.register(RouterStatsSample)
class RouterStatsSampleAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["router", "received_at", "request_rate", "policy_version"]
    list_filter = ["router"]
