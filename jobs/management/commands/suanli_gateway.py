"""`gateway` (Procfile): the SSH gateway, jobs/access/ssh.py. Listens on SUANLI_SSH_BIND:
SUANLI_SSH_PORT until SIGTERM, then closes its connections, hanging up what they started.

Layer: management, the top of jobs/; uses access.ssh (the only process that imports asyncssh)."""

import logging

from django.core.management.base import BaseCommand

from jobs.access import ssh


class Command(BaseCommand):
    help = "Serve ssh, scp/sftp and port forwarding into the clusters' workspaces."

    def handle(self, *args, **options):
        logging.basicConfig(level=logging.INFO)
        ssh.run()
