"""No input file leaves its batch stuck: a line that breaks the parser fails alone, a file
whose check breaks fails its batch, and a batch past its window expires however it got there."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.batches import runner, services
from controlplane.batches.models import Batch
from controlplane.batches.tasks import sweep
from tests.controlplane.batches.conftest import file_bytes, jsonl, line
from tests.controlplane.batches.test_runner import make_batch

DEEP = b'{"custom_id": "deep", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"


def broken_parser(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def parse(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise RuntimeError("the parser has a bug")

    monkeypatch.setattr(services, "parse_input", parse)
    return calls


def test_a_line_nested_5000_deep_fails_alone_and_the_other_lines_run(
    db, queued, batch_settings, fake_router
) -> None:
    batch = make_batch(jsonl(line("a", "first"), DEEP, line("b", "last")))
    assert runner.execute(batch.id) == "completed"
    batch.refresh_from_db()
    assert (batch.status, batch.total, batch.completed, batch.failed) == ("completed", 3, 2, 1)
    [failure] = [json.loads(x) for x in file_bytes(batch.error_file).splitlines()]
    assert failure["custom_id"] is None
    assert failure["error"]["code"] == "too_deeply_nested"
    assert failure["error"]["line"] == 2
    assert failure["error"]["message"].startswith("line 2: nests arrays and objects")


def test_an_unexpected_error_in_validation_fails_the_batch_with_a_message(
    db, queued, batch_settings, monkeypatch
) -> None:
    broken_parser(monkeypatch)
    batch = make_batch(jsonl(line("a", "x")))
    assert runner.execute(batch.id) == "failed"
    batch.refresh_from_db()
    assert batch.status == "failed" and batch.failed_at is not None
    [error] = batch.errors
    assert error["code"] == "validation_error"
    assert "could not be validated (RuntimeError)" in error["message"]
    # A failed batch is final: the sweep never reads its file again.
    Batch.objects.filter(pk=batch.id).update(lease_until=timezone.now() - timedelta(seconds=1))
    queued.clear()
    assert sweep() == 0 and queued == []


def test_a_validating_batch_past_its_window_expires_through_its_task_unread(
    db, queued, batch_settings, monkeypatch
) -> None:
    calls = broken_parser(monkeypatch)
    batch = make_batch(jsonl(line("a", "x")))
    Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert runner.execute(batch.id) == "expired"
    batch.refresh_from_db()
    assert batch.status == "expired" and batch.expired_at is not None
    assert calls == []


def test_the_sweep_expires_a_validating_batch_past_its_window_whose_task_keeps_failing(
    db, queued, batch_settings, monkeypatch
) -> None:
    batch = make_batch(jsonl(line("a", "x")))
    # Its task died before validating it, again and again, until its window passed.
    Batch.objects.filter(pk=batch.id).update(
        lease_owner="w1",
        lease_until=timezone.now() - timedelta(seconds=1),
        expires_at=timezone.now() - timedelta(seconds=1),
    )
    queued.clear()
    assert sweep() == 1
    assert queued == []  # ended, not queued again
    batch.refresh_from_db()
    assert (batch.status, batch.lease_owner) == ("expired", "")
    assert sweep() == 0
