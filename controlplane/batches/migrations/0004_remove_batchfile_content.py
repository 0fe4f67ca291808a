from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0003_batchfile_content_to_chunks"),
    ]

    operations = [
        migrations.RemoveField(
            model_name="batchfile",
            name="content",
        ),
    ]
