"""A file's bytes in the database as ordered chunks of at most 1 MiB (decision 0055), and
what one tenant may store (``BATCH_MAX_FILES_PER_OWNER``, ``BATCH_MAX_BYTES_PER_OWNER``)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from controlplane.batches import models, runner, services
from controlplane.batches.models import Batch, BatchFile, BatchFileChunk
from tests.controlplane.batches.conftest import file_bytes, jsonl, line
from tests.controlplane.batches.test_api import upload
from tests.controlplane.batches.test_runner import make_batch

MIB = 1024 * 1024


def chunk_sizes(file: BatchFile | None) -> list[int]:
    assert file is not None
    return [len(bytes(d)) for d in file.chunks.order_by("index").values_list("data", flat=True)]


def test_an_upload_is_stored_in_chunks_of_1_mib_and_streamed_back_whole(acme, client_for) -> None:
    client = client_for(acme[1])
    content = jsonl(*(line(f"r{i}", "x" * 1000) for i in range(2600)))
    assert len(content) > 2.5 * MIB
    created = upload(client, content)
    assert created.bytes == len(content)
    stored = BatchFile.objects.get(pk=created.id)
    assert chunk_sizes(stored) == [MIB, MIB, len(content) - 2 * MIB]
    answer = client.files.with_raw_response.content(created.id)
    assert answer.headers["Content-Length"] == str(len(content))
    assert answer.content == content


def test_lines_are_validated_across_chunks_and_results_written_in_chunks(
    db, queued, batch_settings, fake_router, monkeypatch
) -> None:
    monkeypatch.setattr(models, "CHUNK_BYTES", 100)
    batch = make_batch(jsonl(*(line(f"r{i}", f"line {i}") for i in range(6))))
    assert batch.input_file is not None and len(chunk_sizes(batch.input_file)) > 6
    assert max(chunk_sizes(batch.input_file)) == 100
    assert runner.execute(batch.id) == "completed"
    batch.refresh_from_db()
    assert (batch.total, batch.completed) == (6, 6)
    assert len(chunk_sizes(batch.output_file)) > 1
    assert max(chunk_sizes(batch.output_file)) == 100
    output = [json.loads(x) for x in file_bytes(batch.output_file).splitlines()]
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(6)]
    assert batch.output_file is not None
    assert batch.output_file.bytes == len(file_bytes(batch.output_file))


def refused(client: openai.OpenAI, content: bytes) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        upload(client, content)
    return raised.value


def test_a_tenant_over_its_file_count_is_refused_naming_the_limit(
    acme, globex, client_for, settings
) -> None:
    settings.BATCH_MAX_FILES_PER_OWNER = 2
    mine, theirs = client_for(acme[1]), client_for(globex[1])
    first = upload(mine, jsonl(line("a", "x")))
    upload(mine, jsonl(line("a", "x")))
    error = refused(mine, jsonl(line("a", "x")))
    assert error.status_code == 403
    assert error.body["code"] == "storage_quota_exceeded"  # type: ignore[index]
    assert "stores 2 files; the limit is 2 files (BATCH_MAX_FILES_PER_OWNER)" in error.message
    assert upload(theirs, jsonl(line("a", "x"))).bytes > 0  # another tenant's own count
    mine.files.delete(first.id)
    assert upload(mine, jsonl(line("a", "x"))).bytes > 0


def test_a_tenant_over_its_bytes_is_refused_naming_the_limit(acme, client_for, settings) -> None:
    settings.BATCH_MAX_BYTES_PER_OWNER = 1500
    client = client_for(acme[1])
    upload(client, b"x" * 1000)
    error = refused(client, b"x" * 600)
    assert error.status_code == 403
    assert error.body["code"] == "storage_quota_exceeded"  # type: ignore[index]
    assert "the limit is 1500 bytes (BATCH_MAX_BYTES_PER_OWNER)" in error.message
    assert BatchFile.objects.filter(owner="acme").count() == 1
    assert upload(client, b"x" * 500).bytes == 500


def test_a_batchs_results_are_always_written_and_count_toward_the_cap(
    db, queued, batch_settings, settings, fake_router
) -> None:
    settings.BATCH_MAX_FILES_PER_OWNER = 1
    batch = make_batch(jsonl(line("a", "fine"), line("b", "fail")))
    assert runner.execute(batch.id) == "completed"
    batch.refresh_from_db()
    assert batch.output_file is not None and batch.error_file is not None
    assert batch.input_file is not None
    caller = services.Caller("acme", batch.input_file.tenant)
    with pytest.raises(services.BatchApiError, match="stores 3 files; the limit is 1 files"):
        services.create_file(caller, filename="more.jsonl", purpose="batch", size=1, pieces=[b"x"])


def test_the_migration_moves_stored_content_into_chunks(transactional_db: Any) -> None:
    executor = MigrationExecutor(connection)
    before, after = (
        [("batches", "0002_batchfilechunk")],
        [("batches", "0004_remove_batchfile_content")],
    )
    executor.migrate(before)
    old = executor.loader.project_state(before).apps.get_model("batches", "BatchFile")
    content = b"0123456789" * (MIB // 4)  # 2.5 MiB
    old.objects.create(
        id="file-old",
        owner="acme",
        purpose="batch",
        filename="a",
        bytes=len(content),
        content=content,
    )
    old.objects.create(id="file-empty", owner="acme", purpose="batch", filename="b", content=b"")
    executor.loader.build_graph()
    executor.migrate(after)
    moved = BatchFile.objects.get(pk="file-old")
    assert chunk_sizes(moved) == [MIB, MIB, len(content) - 2 * MIB]
    assert file_bytes(moved) == content
    assert not BatchFileChunk.objects.filter(file_id="file-empty").exists()
    assert Batch.objects.count() == 0
