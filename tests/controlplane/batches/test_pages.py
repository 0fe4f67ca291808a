"""The dashboard's batch pages: every batch with its progress, and one batch's page."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from controlplane.batches.choices import BatchStatus, LineStatus
from controlplane.batches.models import Batch, BatchLine


def _batch(owner: str, status: str, total: int, completed: int, failed: int) -> Batch:
    batch = Batch.objects.create(
        owner=owner,
        endpoint="/v1/chat/completions",
        status=status,
        input_file_ref="file-x",
        total=total,
        completed=completed,
        failed=failed,
        expires_at=timezone.now() + timedelta(hours=24),
    )
    for n in range(1, total + 1):
        state = (
            LineStatus.DONE
            if n <= completed
            else LineStatus.FAILED
            if n <= completed + failed
            else LineStatus.PENDING
        )
        error = {"code": "invalid_json", "message": f"line {n}: bad"} if state == "failed" else None
        BatchLine.objects.create(
            batch=batch, line_no=n, custom_id=f"c{n}", status=state, error=error
        )
    return batch


@pytest.fixture
def viewer(db) -> Client:
    user = User.objects.create_user("batch-viewer", password="x-unused-x")
    client = Client()
    client.force_login(user)
    return client


def test_the_list_shows_each_batch_with_its_progress_and_refreshes_while_one_moves(
    viewer,
) -> None:
    moving = _batch("acme", BatchStatus.IN_PROGRESS, 4, 1, 1)
    done = _batch("globex", BatchStatus.COMPLETED, 2, 2, 0)
    page = viewer.get("/batches/").content.decode()
    assert moving.id in page and done.id in page
    assert '<progress max="4" value="2"' in page and "50%" in page
    assert 'http-equiv="refresh"' in page
    only = viewer.get("/batches/?status=completed").content.decode()
    assert done.id in only and moving.id not in only
    assert 'http-equiv="refresh"' not in only  # nothing there moves
    mine = viewer.get("/batches/?owner=acme").content.decode()
    assert moving.id in mine and done.id not in mine


def test_a_batch_page_counts_its_lines_and_names_its_failed_ones(viewer) -> None:
    batch = _batch("acme", BatchStatus.IN_PROGRESS, 5, 2, 1)
    page = viewer.get(f"/batches/{batch.id}/").content.decode()
    assert "2 completed, 1 failed of 5 lines" in page
    assert "2 pending, 2 done, 1 failed" in page
    assert "line 3: bad" in page and "c3" in page
    assert viewer.get("/batches/batch_nope/").status_code == 404


def test_the_pages_need_a_signed_in_user(db) -> None:
    batch = _batch("acme", BatchStatus.COMPLETED, 1, 1, 0)
    client = Client()
    for url in ("/batches/", f"/batches/{batch.id}/"):
        answer = client.get(url)
        assert answer.status_code == 302 and "/accounts/login/" in answer["Location"]
