"""RQ cron configuration: `python manage.py rqcron console.cron` (see Procfile)."""

from django.conf import settings
from rq import cron

from jobs import tasks as job_tasks

cron.register(job_tasks.hosts_check_all, "default", interval=settings.SUANLI_HOST_CHECK_INTERVAL)
