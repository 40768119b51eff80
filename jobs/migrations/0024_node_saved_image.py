from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0023_public_datasets"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="saved_image",
            field=models.CharField(
                blank=True,
                help_text="Its workspace's root filesystem in the registry (reference@digest): on a kept node, pushed after the stop (empty until then), so the cluster can start on another host; on a node started elsewhere, the save its workspace is made from.",
                max_length=400,
            ),
        ),
    ]
