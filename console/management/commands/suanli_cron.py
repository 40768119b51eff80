"""RQ's cron scheduler, enqueueing through our queues.

RQ's own CronJob.enqueue builds a bare Queue (pickle serializer, no deduplication). Our
queues use the JSON serializer, and a periodic task that is still waiting must not be
queued again behind itself, so due jobs go through `enqueue_unique` instead.

RQ's own loop (CronScheduler.start) ends the process on the first Redis error; ours lives
through a Redis restart or outage: it logs it once, retries with backoff, and registers
itself again once Redis answers (a restarted Redis has lost the scheduler's keys). A job
that fell due meanwhile is enqueued once when Redis is back, not once per missed interval.
"""

import logging
import time

from django.core.management.base import BaseCommand
from django_rq.cron import DjangoCronScheduler
from rq.exceptions import StopRequested
from rq.utils import now

from jobs.base import metrics
from jobs.base.outage import REDIS_DOWN, Outage
from jobs.base.queue import enqueue_unique


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

    def start(self):
        self.log.info("CronScheduler %s: starting...", self.name)
        self._install_signal_handlers()
        redis = Outage("Redis (cron)", self.log)
        registered = False
        try:
            while True:
                try:
                    if not registered:
                        if redis.down:
                            self.connection.ping()  # quietly, until Redis is back
                        self.register_birth()
                        registered = True
                    if self.enqueue_jobs():
                        self.save()  # the jobs' timings, for the dashboard
                    self.heartbeat()
                    metrics.alive("cron")
                except REDIS_DOWN as exc:
                    registered = False
                    time.sleep(redis.failed(exc))
                    continue
                redis.ok()
                sleep_time = self.calculate_sleep_interval()
                if sleep_time > 0:
                    time.sleep(sleep_time)
        except KeyboardInterrupt:
            self.log.info("CronScheduler %s: received KeyboardInterrupt", self.name)
        except StopRequested:
            self.log.info("CronScheduler %s: stop requested", self.name)
        finally:
            try:
                self.register_death()
            except REDIS_DOWN:
                pass  # Redis is away: its registry entry expires on its own
            self.log.info("CronScheduler %s: shutdown complete", self.name)


class Command(BaseCommand):
    help = "Run the periodic tasks (placement, host checks, ...) on RQ's cron scheduler."

    def add_arguments(self, parser):
        parser.add_argument("config_path", nargs="?", default="console.cron")

    def handle(self, *args, config_path, **options):
        metrics.serve("cron")
        scheduler = SuanliCronScheduler(logging_level=logging.INFO)
        scheduler.load_config_from_file(config_path)
        self.stdout.write(f"cron: {len(scheduler.get_jobs())} periodic tasks from {config_path}")
        scheduler.start()
