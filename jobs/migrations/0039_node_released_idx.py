from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0038_teams"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="node",
            index=models.Index(fields=["released_at"], name="node_released_idx"),
        ),
    ]
