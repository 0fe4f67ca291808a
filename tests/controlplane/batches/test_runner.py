"""The batch worker: resuming after a crash without running a finished line again, the lease
that keeps two workers off one batch, retries, expiry and the sweep."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.access.models import MachineCredential
from controlplane.batches import runner, services
from controlplane.batches.auth import Caller
from controlplane.batches.models import Batch, BatchLine
from controlplane.batches.tasks import sweep
from controlplane.routers.models import RouterInstance
from tests.controlplane.batches.conftest import file_bytes, jsonl, line, make_tenant


class WorkerDied(BaseException):
    """Stands for the worker process dying: nothing after it runs, not even an except."""


def make_batch(content: bytes, owner: str = "acme") -> Batch:
    tenant, _ = make_tenant(owner)
    caller = Caller(owner, tenant)
    source = services.create_file(
        caller, filename="in.jsonl", purpose="batch", size=len(content), pieces=[content]
    )
    return services.create_batch(
        caller,
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def prompts(requests: list[dict[str, Any]]) -> list[str]:
    return [r["body"]["messages"][0]["content"] for r in requests]


@pytest.fixture
def twelve(db: Any, queued: list[str]) -> Batch:
    return make_batch(jsonl(*(line(f"r{i}", f"line {i}") for i in range(12))))


def test_a_worker_killed_mid_batch_resumes_without_running_a_finished_line_again(
    twelve, batch_settings, fake_router
) -> None:
    batch_settings.BATCH_CONCURRENCY = 2
    # The worker dies after storing four lines (others under way), its lease still held.
    original = services.record_result
    stored: list[int] = []

    def record_then_die(line: BatchLine, **kwargs: Any) -> bool:
        if len(stored) == 4:
            raise WorkerDied
        stored.append(line.line_no)
        return original(line, **kwargs)

    services_record = "controlplane.batches.services.record_result"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(services_record, record_then_die)
        with pytest.raises(WorkerDied):
            runner.execute(twelve.id)
    finished = set(
        BatchLine.objects.filter(batch=twelve)
        .exclude(status="pending")
        .values_list("custom_id", flat=True)
    )
    assert len(finished) == 4
    # A dead process never releases its lease: until it runs out, another worker leaves
    # the batch alone.
    Batch.objects.filter(pk=twelve.id).update(
        lease_owner="dead-worker", lease_until=timezone.now() + timedelta(seconds=60)
    )
    assert runner.execute(twelve.id) == "held by another worker"
    # The lease runs out; the sweep queues the batch again and a new worker finishes it.
    Batch.objects.filter(pk=twelve.id).update(lease_until=timezone.now() - timedelta(seconds=1))
    fake_router.on_request = None
    before = len(fake_router.requests)
    assert services.requeue_stranded() == [twelve.id]
    assert runner.execute(twelve.id) == "completed"

    resent = prompts(fake_router.requests[before:])
    assert not {f"line {custom_id[1:]}" for custom_id in finished} & set(resent)
    twelve.refresh_from_db()
    assert (twelve.total, twelve.completed, twelve.failed) == (12, 12, 0)
    output = file_bytes(twelve.output_file).splitlines()
    assert [json.loads(x)["custom_id"] for x in output] == [f"r{i}" for i in range(12)]


def test_a_redelivered_task_runs_nothing_twice(twelve, batch_settings, fake_router) -> None:
    assert runner.execute(twelve.id) == "completed"
    assert runner.execute(twelve.id) == "completed"
    assert len(fake_router.requests) == 12


def test_a_429_is_tried_again_after_retry_after(db, queued, batch_settings, fake_router):
    batch = make_batch(jsonl(line("a", "busy now"), line("b", "fine")))
    assert runner.execute(batch.id) == "completed"
    batch.refresh_from_db()
    assert batch.completed == 2
    assert prompts(fake_router.requests).count("busy now") == 2


def test_failures_go_to_the_error_file(db, queued, batch_settings, fake_router) -> None:
    batch = make_batch(jsonl(line("a", "crash"), line("b", "fine")))
    assert runner.execute(batch.id) == "completed"
    batch.refresh_from_db()
    assert (batch.completed, batch.failed) == (1, 1)
    [failure] = [json.loads(x) for x in file_bytes(batch.error_file).splitlines()]
    assert failure["custom_id"] == "a"
    assert failure["response"]["status_code"] == 500
    assert failure["error"]["code"] == "internal_error"


def test_a_router_that_does_not_answer_fails_the_lines_after_the_tries(
    db, queued, batch_settings, monkeypatch
) -> None:
    batch_settings.BATCH_ROUTER_URL = "http://127.0.0.1:9"  # discard: nothing listens
    batch_settings.BATCH_MAX_ATTEMPTS = 1
    batch = make_batch(jsonl(line("a", "x")))
    assert runner.execute(batch.id) == "completed"
    batch.refresh_from_db()
    [failure] = [json.loads(x) for x in file_bytes(batch.error_file).splitlines()]
    assert failure["error"]["code"] == "router_unreachable"


def test_without_a_live_router_the_batch_waits(db, queued, batch_settings) -> None:
    batch_settings.BATCH_ROUTER_URL = ""
    batch = make_batch(jsonl(line("a", "x")))
    assert runner.execute(batch.id) == "waiting for a router"
    batch.refresh_from_db()
    assert batch.status == "in_progress" and batch.lease_owner == ""


def test_the_live_configured_router_seen_last_gets_the_lines(
    db, queued, batch_settings, fake_router
):
    batch_settings.BATCH_ROUTER_URL = ""
    batch_settings.ROUTER_URLS = ["http://127.0.0.1:9", fake_router.url]
    credential, _ = MachineCredential.issue("router", "r")
    now = timezone.now()
    RouterInstance.objects.create(
        name="old",
        credential=credential,
        listen_url="http://127.0.0.1:9",
        last_seen_at=now - timedelta(hours=1),
    )
    RouterInstance.objects.create(
        name="live", credential=credential, listen_url=fake_router.url, last_seen_at=now
    )
    assert runner.router_url() == fake_router.url


def test_an_expired_batch_fails_its_unfinished_lines(twelve, batch_settings, fake_router):
    services.validate(twelve.id)
    BatchLine.objects.filter(batch=twelve, line_no__lte=2).update(
        status="done", response={"status_code": 200, "request_id": "x", "body": {}}
    )
    Batch.objects.filter(pk=twelve.id).update(
        completed=2, expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert runner.execute(twelve.id) == "expired"
    twelve.refresh_from_db()
    assert (twelve.completed, twelve.failed) == (2, 10)
    errors = [json.loads(x) for x in file_bytes(twelve.error_file).splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert fake_router.requests == []


def test_the_sweep_queues_only_batches_whose_worker_went_silent(db, queued, batch_settings) -> None:
    silent = make_batch(jsonl(line("a", "x")))
    running = make_batch(jsonl(line("a", "x")), owner="globex")
    Batch.objects.filter(pk=silent.id).update(
        lease_owner="w1", lease_until=timezone.now() - timedelta(seconds=1)
    )
    Batch.objects.filter(pk=running.id).update(
        lease_owner="w2", lease_until=timezone.now() + timedelta(seconds=60)
    )
    queued.clear()
    assert sweep() == 1
    assert queued == [silent.id]
    assert sweep() == 0  # queued again: it has BATCH_QUEUED_SECONDS to start


def test_the_request_headers_act_for_the_tenant(settings) -> None:
    settings.ROUTER_API_KEY = "k"
    assert runner.request_headers("acme")["X-Syshax-Tenant"] == "acme"
    assert "X-Syshax-Tenant" not in runner.request_headers("router-key")
    settings.ROUTER_API_KEY = ""
    assert "Authorization" not in runner.request_headers("anonymous")
