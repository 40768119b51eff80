# A job's progress points move out of the Job row (every job list read them) into a row of
# their own, read only where one job's pace is worked out.

import django.db.models.deletion
from django.db import migrations, models


def points_out(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    JobProgress = apps.get_model("jobs", "JobProgress")
    rows = (
        Job.objects.exclude(progress=[], progress_seq=0)
        .values_list("pk", "progress", "progress_seq", "attempt")
        .iterator(chunk_size=200)
    )
    batch = []
    for pk, points, seq, attempt in rows:
        batch.append(JobProgress(job_id=pk, points=points or [], seq=seq, attempt=attempt or 1))
        if len(batch) >= 200:
            JobProgress.objects.bulk_create(batch)
            batch = []
    JobProgress.objects.bulk_create(batch)


def points_back(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    JobProgress = apps.get_model("jobs", "JobProgress")
    for row in JobProgress.objects.iterator(chunk_size=200):
        Job.objects.filter(pk=row.job_id).update(progress=row.points, progress_seq=row.seq)


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0047_sweep_budget_hold"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobProgress",
            fields=[
                (
                    "job",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="progress_row",
                        serialize=False,
                        to="jobs.job",
                    ),
                ),
                ("points", models.JSONField(blank=True, default=list)),
                ("seq", models.BigIntegerField(default=0)),
                ("attempt", models.PositiveSmallIntegerField(default=1)),
            ],
            options={
                "verbose_name": "job progress",
                "verbose_name_plural": "job progress",
            },
        ),
        migrations.RunPython(points_out, points_back),
        migrations.RemoveField(model_name="job", name="progress"),
        migrations.RemoveField(model_name="job", name="progress_seq"),
    ]
