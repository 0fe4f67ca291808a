"""OpenAI's Batch API paths, mounted at ``/v1/`` (not under ``/api/v1/``: the official client
appends them to the base URL it is given)."""

from __future__ import annotations

from django.urls import path, re_path

from controlplane.batches import views

urlpatterns = [
    path("files", views.files, name="openai-files"),
    path("files/<str:file_id>", views.file_detail, name="openai-file"),
    path("files/<str:file_id>/content", views.file_content, name="openai-file-content"),
    path("batches", views.batches, name="openai-batches"),
    path("batches/<str:batch_id>", views.batch_detail, name="openai-batch"),
    path("batches/<str:batch_id>/cancel", views.batch_cancel, name="openai-batch-cancel"),
    re_path(r"^(?P<rest>.*)$", views.unknown),
]
