import django.db.models.deletion
import django.db.models.manager
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0024_node_saved_image"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="host",
            options={
                "default_manager_name": "all_objects",
                "ordering": ["zone", "name"],
                "permissions": [
                    ("drain_host", "Can drain and undrain hosts"),
                    (
                        "reclaim_spot",
                        "Can reclaim a host's spot capacity (preempts its spot clusters)",
                    ),
                ],
                "verbose_name": "host",
                "verbose_name_plural": "hosts",
            },
        ),
        migrations.AlterModelManagers(
            name="host",
            managers=[("all_objects", django.db.models.manager.Manager())],
        ),
        migrations.AlterField(
            model_name="host",
            name="state",
            field=models.CharField(
                choices=[
                    ("active", "active"),
                    ("draining", "draining"),
                    ("degraded", "degraded"),
                    ("down", "down"),
                    ("left", "left"),
                ],
                default="down",
                max_length=10,
            ),
        ),
        migrations.CreateModel(
            name="HostJoin",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key", models.CharField(max_length=16, unique=True)),
                ("digest", models.CharField(max_length=64)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("expires_at", models.DateTimeField()),
                ("zone", models.SlugField(max_length=40)),
                ("gpu_count", models.PositiveSmallIntegerField(default=0)),
                ("build_host", models.BooleanField(default=False)),
                ("address", models.GenericIPAddressField(blank=True, null=True)),
                (
                    "kind",
                    models.CharField(
                        choices=[("join", "join"), ("leave", "leave")], default="join", max_length=5
                    ),
                ),
                ("used_at", models.DateTimeField(blank=True, null=True)),
                ("host_name", models.CharField(blank=True, max_length=63)),
                ("host_address", models.GenericIPAddressField(blank=True, null=True)),
                ("host_digest", models.CharField(blank=True, max_length=64)),
                ("step", models.CharField(blank=True, max_length=20)),
                ("error", models.TextField(blank=True)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "created_by",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                (
                    "gpu_model",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="jobs.gpumodel",
                    ),
                ),
                (
                    "host",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="joins",
                        to="jobs.host",
                    ),
                ),
            ],
            options={
                "verbose_name": "host join",
                "verbose_name_plural": "host joins",
                "ordering": ["-created_at"],
            },
        ),
    ]
