"""`monitor` (Procfile): sample every running replica once a second.

Run one per set of hosts with `--shard I/N` (hosts whose id % N == I)."""

import asyncio
import logging
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from jobs.base import metrics
from monitoring.monitor import Monitor

log = logging.getLogger("suanli.monitor")


class Command(BaseCommand):
    help = "Sample running replicas (CPU, memory, GPU, network, disk) once a second."

    def add_arguments(self, parser):
        parser.add_argument("--shard", default="0/1", help="I/N: this monitor's share of hosts")

    def handle(self, *args, shard: str, **options):
        try:
            index, count = (int(x) for x in shard.split("/"))
            if not 0 <= index < count:
                raise ValueError
        except ValueError as exc:
            raise CommandError("--shard is I/N with 0 <= I < N, e.g. 0/2") from exc
        metrics.serve("monitor")
        asyncio.run(self._run((index, count)))

    async def _run(self, shard):
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        monitor = Monitor(shard=shard, interval=settings.SUANLI_MONITOR_INTERVAL)
        self.stdout.write(f"monitor: shard {shard[0]}/{shard[1]}, every {monitor.interval} s")
        try:
            await monitor.run(stop)
        finally:
            monitor.close()
