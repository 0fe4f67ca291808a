"""Each file's ``content`` copied into chunks of at most 1 MiB (decision 0055), one file at a
time; backwards, the chunks joined into ``content`` again. A migration of its own: PostgreSQL
cannot alter ``batchfile`` (0004) in the transaction that wrote rows referring to it."""

from typing import Any

from django.db import migrations

CHUNK_BYTES = 1024 * 1024  # models.CHUNK_BYTES when this was written


def to_chunks(apps: Any, schema_editor: Any) -> None:
    BatchFile = apps.get_model("batches", "BatchFile")
    BatchFileChunk = apps.get_model("batches", "BatchFileChunk")
    for pk in list(BatchFile.objects.values_list("pk", flat=True)):
        content = bytes(BatchFile.objects.filter(pk=pk).values_list("content", flat=True)[0])
        BatchFileChunk.objects.bulk_create(
            BatchFileChunk(file_id=pk, index=index, data=content[start : start + CHUNK_BYTES])
            for index, start in enumerate(range(0, len(content), CHUNK_BYTES))
        )


def to_content(apps: Any, schema_editor: Any) -> None:
    BatchFile = apps.get_model("batches", "BatchFile")
    BatchFileChunk = apps.get_model("batches", "BatchFileChunk")
    for pk in list(BatchFile.objects.values_list("pk", flat=True)):
        pieces = BatchFileChunk.objects.filter(file_id=pk).order_by("index")
        content = b"".join(bytes(p) for p in pieces.values_list("data", flat=True))
        BatchFile.objects.filter(pk=pk).update(content=content)
    BatchFileChunk.objects.all().delete()


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0002_batchfilechunk"),
    ]

    operations = [
        migrations.RunPython(to_chunks, to_content),
    ]
