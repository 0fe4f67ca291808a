"""The official ``openai`` client's file and batch calls against the control plane's ``/v1``,
with the worker run inline against a fake router."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from controlplane.batches import runner
from controlplane.batches.models import Batch
from tests.controlplane.batches.conftest import jsonl, line


def upload(client: openai.OpenAI, content: bytes, name: str = "input.jsonl") -> Any:
    return client.files.create(file=(name, content), purpose="batch")


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]


def test_a_batch_end_to_end(acme, client_for, batch_settings, fake_router, queued) -> None:
    _, key = acme
    client = client_for(key)
    source = upload(client, jsonl(line("a", "hello"), line("b", "world")))
    assert source.object == "file" and source.purpose == "batch" and source.bytes > 0
    assert client.files.retrieve(source.id).filename == "input.jsonl"

    batch = client.batches.create(
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert queued == [batch.id]

    assert runner.execute(batch.id) == "completed"

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert done.request_counts.total == 2 and done.request_counts.completed == 2
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = results(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == ["a", "b"]
    assert out[0]["error"] is None and out[0]["id"].startswith("batch_req_")
    assert out[0]["response"]["status_code"] == 200
    assert (
        out[0]["response"]["body"]["choices"][0]["message"]["content"]
        == 'echo [{"role": "user", "content": "hello"}]'
    )
    # Through the router at the batch class, as the tenant, with the router's own key.
    for sent in fake_router.requests:
        assert sent["path"] == "/v1/chat/completions"
        assert sent["headers"]["X-Syshax-Tenant"] == "acme"
        assert sent["headers"]["Authorization"] == "Bearer router-secret"
        assert sent["body"]["service_tier"] == "flex" and sent["body"]["stream"] is False
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_bad_lines_are_named_in_the_error_file_and_the_good_lines_run(
    acme, client_for, batch_settings, fake_router, queued
) -> None:
    _, key = acme
    client = client_for(key)
    content = jsonl(
        line("ok-1", "one"),
        b"{not json",
        line("ok-1", "duplicate id"),
        line("wrong-url", "x", url="/v1/embeddings"),
        line("wrong-method", "x", method="GET"),
        line("no-model", "x", model=""),
        line("other-model", "x", model="huge"),
        {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},
        line("refused", "fail please"),
        line("ok-2", "two"),
    )
    batch = client.batches.create(
        input_file_id=upload(client, content).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert runner.execute(batch.id) == "completed"

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (10, 2, 8)
    assert [r["custom_id"] for r in results(client, done.output_file_id)] == ["ok-1", "ok-2"]
    errors = {
        r["error"]["line"] if "line" in r["error"] else r["custom_id"]: r
        for r in results(client, done.error_file_id)
    }
    assert errors[2]["error"]["code"] == "invalid_json" and errors[2]["custom_id"] is None
    assert errors[3]["error"]["param"] == "custom_id"
    assert "line 3" in errors[3]["error"]["message"]
    assert errors[4]["error"]["param"] == "url" and errors[4]["custom_id"] == "wrong-url"
    assert errors[5]["error"]["param"] == "method"
    assert errors[6]["error"]["param"] == "body.model"
    assert errors[7]["error"]["code"] == "model_not_allowed"
    assert errors[8]["error"]["param"] == "body"
    # The router's own refusal, with its answer.
    assert errors["refused"]["response"]["status_code"] == 400
    assert errors["refused"]["error"]["code"] == "invalid_value"
    assert len(fake_router.requests) == 3  # the bad lines never reached the router


def test_a_file_without_a_valid_line_fails_the_batch(acme, client_for, batch_settings, queued):
    _, key = acme
    client = client_for(key)
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(b"[]", line("x", "y", url="/v1/completions"))).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert runner.execute(batch.id) == "failed"
    failed = client.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.failed_at
    assert failed.errors is not None and failed.errors.data is not None
    assert [e.line for e in failed.errors.data] == [1, 2]
    assert failed.errors.data[1].param == "url"


def test_over_the_line_cap_the_batch_fails_naming_the_limit(
    acme, client_for, batch_settings, queued
) -> None:
    batch_settings.BATCH_MAX_LINES = 2
    _, key = acme
    client = client_for(key)
    content = jsonl(*(line(f"r{i}", "x") for i in range(3)))
    batch = client.batches.create(
        input_file_id=upload(client, content).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    runner.execute(batch.id)
    failed = client.batches.retrieve(batch.id)
    assert failed.status == "failed"
    assert failed.errors is not None and failed.errors.data is not None
    message = failed.errors.data[0].message or ""
    assert "3 requests" in message and "limit is 2" in message and "BATCH_MAX_LINES" in message


def test_a_file_over_the_cap_is_refused_naming_the_limit(acme, client_for, settings) -> None:
    settings.BATCH_MAX_FILE_BYTES = 2048
    _, key = acme
    with pytest.raises(openai.APIStatusError) as raised:
        upload(client_for(key), b"x" * 4096)
    assert raised.value.status_code == 413
    assert "limit is 2048 bytes" in raised.value.message


def test_a_large_upload_passes_the_general_body_limit(acme, client_for, settings) -> None:
    settings.MAX_REQUEST_BODY_BYTES = 4096
    settings.BODY_LIMITS_BY_PATH = {"/v1/files": 64 * 1024}
    _, key = acme
    content = jsonl(*(line(f"r{i}", "x" * 100) for i in range(100)))
    assert len(content) > 4096
    assert upload(client_for(key), content).bytes == len(content)


def test_a_tenant_sees_only_its_own_files_and_batches(
    acme, globex, client_for, batch_settings, queued
) -> None:
    mine, theirs = client_for(acme[1]), client_for(globex[1])
    source = upload(mine, jsonl(line("a", "b")))
    batch = mine.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: theirs.batches.retrieve(batch.id),
        lambda: theirs.batches.cancel(batch.id),
        lambda: theirs.files.retrieve(source.id),
        lambda: theirs.files.content(source.id),
        lambda: theirs.files.delete(source.id),
        lambda: theirs.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(theirs.batches.list()) == [] and list(theirs.files.list()) == []
    assert [f.id for f in mine.files.list()] == [source.id]


def test_a_router_acts_only_for_its_own_callers(
    acme, router_token, client_for, batch_settings, queued
) -> None:
    # A tenant's requests carry its own key (decision 57): a router token naming it is refused.
    with pytest.raises(openai.PermissionDeniedError):
        upload(client_for(router_token, **{"X-Syshax-Tenant": "acme"}), jsonl(line("a", "b")))
    source = upload(client_for(acme[1]), jsonl(line("a", "b")))
    assert [f.id for f in client_for(acme[1]).files.list()] == [source.id]
    # The routers' own callers own batches too, apart from every tenant.
    as_key = client_for(router_token, **{"X-Syshax-Tenant": "router-key"})
    assert list(as_key.files.list()) == []
    mine = upload(as_key, jsonl(line("a", "b")))
    assert [f.id for f in as_key.files.list()] == [mine.id]
    assert [f.id for f in client_for(acme[1]).files.list()] == [source.id]
    with pytest.raises(openai.PermissionDeniedError):
        client_for(router_token, **{"X-Syshax-Tenant": "nobody"}).files.list()
    with pytest.raises(openai.BadRequestError):
        client_for(router_token).files.list()
    # A tenant's key cannot act for another tenant.
    with pytest.raises(openai.PermissionDeniedError):
        client_for(acme[1], **{"X-Syshax-Tenant": "globex"}).files.list()


def test_wrong_keys_are_refused_in_openai_shape(acme, live_server, client_for) -> None:
    for key in ("sk-shx-unknown", "sxa_agent", "sxr_unknown", "nonsense"):
        with pytest.raises(openai.AuthenticationError):
            client_for(key).batches.list()
    answer = httpx.get(f"{live_server.url}/v1/batches")
    assert answer.status_code == 401
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    unknown = httpx.get(f"{live_server.url}/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


def test_create_checks_its_fields(acme, client_for, queued) -> None:
    client = client_for(acme[1])
    source = upload(client, jsonl(line("a", "b")))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-nope"}, "id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]
    for change, param in cases:
        fields = {
            "input_file_id": source.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **change,
        }
        with pytest.raises(openai.APIStatusError) as raised:
            client.batches.create(**fields)
        assert raised.value.body["param"] == param, change  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert queued == []


def test_list_pages_with_after(acme, client_for, queued) -> None:
    client = client_for(acme[1])
    source = upload(client, jsonl(line("a", "b")))
    made = [
        client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert first.has_more and len(first.data) == 2
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert not rest.has_more
    assert sorted(b.id for b in [*first.data, *rest.data]) == sorted(made)
    assert [b.id for b in client.batches.list(limit=1)] != []
    assert sorted(b.id for b in client.batches.list(limit=1)) == sorted(made)  # auto-paging


def test_cancel_keeps_what_finished(acme, client_for, batch_settings, fake_router, queued):
    client = client_for(acme[1])
    content = jsonl(*(line(f"r{i}", f"line {i}") for i in range(12)))
    batch = client.batches.create(
        input_file_id=upload(client, content).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch_settings.BATCH_CONCURRENCY = 1

    def cancel_after_three(body: dict[str, Any]) -> None:
        if len(fake_router.requests) == 3:
            Batch.objects.filter(pk=batch.id).update(status="cancelling")

    fake_router.on_request = cancel_after_three
    assert runner.execute(batch.id) == "cancelled"
    cancelled = client.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    assert cancelled.request_counts.completed == 3
    assert len(results(client, cancelled.output_file_id)) == 3
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change


def test_cancel_through_the_api(acme, client_for, queued) -> None:
    client = client_for(acme[1])
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(line("a", "b"))).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert queued == [batch.id, batch.id]  # the worker finishes it
    assert runner.execute(batch.id) == "cancelled"
    done = client.batches.create(
        input_file_id=batch.input_file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    Batch.objects.filter(pk=done.id).update(status="completed")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)


def test_files_delete(acme, client_for) -> None:
    client = client_for(acme[1])
    source = upload(client, jsonl(line("a", "b")))
    deleted = client.files.delete(source.id)
    assert deleted.deleted and deleted.id == source.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)
