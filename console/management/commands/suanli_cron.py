"""RQ's cron scheduler, enqueueing through our queues.

RQ's own CronJob.enqueue builds a bare Queue (pickle serializer, no deduplication). Our
queues use the JSON serializer, and a periodic task that is still waiting must not be
queued again behind itself, so due jobs go through `enqueue_unique` instead.
"""

import logging

from django.core.management.base import BaseCommand
from django_rq.cron import DjangoCronScheduler
from rq.utils import now

from jobs.tasks import enqueue_unique


class SuanliCronScheduler(DjangoCronScheduler):
    def enqueue_jobs(self):
        enqueue_time = now()
        enqueued = []
        for job in self._cron_jobs:
            if job.should_run():
                enqueue_unique(
                    job.queue_name,
                    job.func,
                    *(job.args or ()),
                    job_id=f"cron-{job.func.__module__}-{job.func.__name__}".replace(".", "-"),
                    **job.job_options,
                )
                job.set_enqueue_time(enqueue_time)
                enqueued.append(job)
        return enqueued


class Command(BaseCommand):
    help = "Run the periodic tasks (placement, host checks, ...) on RQ's cron scheduler."

    def add_arguments(self, parser):
        parser.add_argument("config_path", nargs="?", default="console.cron")

    def handle(self, *args, config_path, **options):
        scheduler = SuanliCronScheduler(logging_level=logging.INFO)
        scheduler.load_config_from_file(config_path)
        self.stdout.write(f"cron: {len(scheduler.get_jobs())} periodic tasks from {config_path}")
        scheduler.start()
