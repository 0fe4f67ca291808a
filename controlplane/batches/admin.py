from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html

from controlplane.batches.models import Batch, BatchFile, BatchLine
from controlplane.core.admin import RecordAdmin


@admin.register(Batch)
class BatchAdmin(RecordAdmin):
    """Batches and their progress; they are created, cancelled and deleted through the Batch
    API (docs/batches.md), so the admin only reads them."""

    list_display = [
        "id",
        "owner",
        "status",
        "progress",
        "total",
        "completed",
        "failed",
        "endpoint",
        "created_at",
        "expires_at",
    ]
    list_filter = ["status", "endpoint"]
    search_fields = ["id", "owner", "input_file_ref"]
    readonly_fields = [f.name for f in Batch._meta.fields]

    @admin.display(description="progress")
    def progress(self, obj: Batch) -> str:
        if not obj.total:
            return "-"
        percent = 100.0 * obj.finished / obj.total
        return format_html(
            '<progress max="{}" value="{}" title="{}"></progress> {}%',
            obj.total,
            obj.finished,
            f"{obj.finished} of {obj.total}",
            f"{percent:.0f}",
        )

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False


@admin.register(BatchFile)
class BatchFileAdmin(RecordAdmin):
    list_display = ["id", "owner", "purpose", "filename", "bytes", "created_at"]
    list_filter = ["purpose"]
    search_fields = ["id", "owner", "filename"]
    # Its bytes (BatchFileChunk rows) are read through the Batch API, never in the admin.
    readonly_fields = ["id", "tenant", "owner", "purpose", "filename", "bytes", "created_at"]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False


@admin.register(BatchLine)
class BatchLineAdmin(RecordAdmin):
    list_display = ["batch", "line_no", "custom_id", "status", "finished_at"]
    list_filter = ["status"]
    search_fields = ["batch__id", "custom_id"]
    readonly_fields = [f.name for f in BatchLine._meta.fields]
    list_select_related = ["batch"]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False
