"""The batch worker: resuming after a crash without running a finished line again, the lease
that keeps two workers off one batch, retries and the waits between them, expiry and the
sweep."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import httpx
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


NO_ANSWER = "no answer"  # the router's port refuses the connection


def send(
    *answers: httpx.Response | str, tries: int, settings: Any
) -> tuple[runner.Outcome, list[float], int]:
    """One line through ``runner.call`` to a router that gives ``answers`` in turn: the
    outcome, the pauses between the tries and how many tries there were."""
    settings.BATCH_MAX_ATTEMPTS = tries
    left = iter(answers)
    sent: list[httpx.Request] = []

    def router(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        answer = next(left)
        if answer == NO_ANSWER:
            raise httpx.ConnectError("connection refused", request=request)
        assert isinstance(answer, httpx.Response)
        return answer

    pauses: list[float] = []
    batch_line = BatchLine(body=line("a", "x")["body"], request_id="req-a")
    with httpx.Client(transport=httpx.MockTransport(router)) as client:
        outcome = runner.call(
            client, "http://router/v1/chat/completions", {}, batch_line, sleep=pauses.append
        )
    return outcome, pauses, len(sent)


def test_busy_answers_wait_their_retry_after_and_silence_waits_1_2_4_s(settings) -> None:
    outcome, pauses, tries = send(
        httpx.Response(503, headers={"Retry-After": "2"}),
        NO_ANSWER,
        httpx.Response(429),  # no Retry-After: 2**attempt
        httpx.Response(502, headers={"Retry-After": "120"}),  # at most MAX_BACKOFF_SECONDS
        httpx.Response(504, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}),
        httpx.Response(503, headers={"Retry-After": "-3"}),
        httpx.Response(200, json={"id": "chatcmpl-1"}),
        tries=8,
        settings=settings,
    )
    assert pauses == [2.0, 2.0, 4.0, 60.0, 16.0, 0.0]
    assert tries == 7
    assert outcome == runner.Outcome(
        True, {"status_code": 200, "request_id": "req-a", "body": {"id": "chatcmpl-1"}}, None
    )


def test_out_of_tries_the_line_gets_the_last_answer(settings) -> None:
    overloaded = {"error": {"code": "overloaded", "message": "every engine is busy"}}
    outcome, pauses, tries = send(
        httpx.Response(429, headers={"Retry-After": "0"}),
        NO_ANSWER,
        httpx.Response(503, json=overloaded, headers={"X-Request-Id": "req-router"}),
        tries=3,
        settings=settings,
    )
    assert (pauses, tries) == ([0.0, 2.0], 3)
    assert outcome == runner.Outcome(
        False,
        {"status_code": 503, "request_id": "req-router", "body": overloaded},
        {"code": "overloaded", "message": "every engine is busy"},
    )


def test_a_router_silent_for_every_try_fails_the_line_as_unreachable(settings) -> None:
    outcome, pauses, tries = send(NO_ANSWER, NO_ANSWER, NO_ANSWER, tries=3, settings=settings)
    assert (pauses, tries) == ([1.0, 2.0], 3)
    message = "the router at http://router/v1/chat/completions did not answer: connection refused"
    assert outcome == runner.Outcome(
        False, None, {"code": "router_unreachable", "message": message}
    )


@pytest.mark.parametrize("status", [400, 500])
def test_any_other_answer_is_the_lines_at_once(settings, status: int) -> None:
    outcome, pauses, tries = send(httpx.Response(status), tries=3, settings=settings)
    assert (pauses, tries) == ([], 1)
    assert outcome.error == {"code": "request_failed", "message": f"the router answered {status}"}
