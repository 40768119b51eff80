"""`logs` (Procfile): one streaming log follower per running replica of every host, its
lines numbered per job in Redis and sent to the job's Channels group (jobs/runs/livelogs.py).
Replicas that start later are picked up; streams an engine drops are opened again from
where they were.

Layer: management, the top of jobs/; uses runs (livelogs)."""

import logging

from django.core.management.base import BaseCommand

from jobs.base import metrics
from jobs.runs.livelogs import Follower


class Command(BaseCommand):
    help = "Follow the running replicas' logs and send them to their jobs' log sockets."

    def handle(self, *args, **options):
        logging.basicConfig(level=logging.WARNING)
        metrics.serve("logs")
        follower = Follower()
        try:
            follower.run()
        except KeyboardInterrupt:
            follower.stop()
