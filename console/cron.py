"""RQ cron configuration: `python manage.py rqcron console.cron` (see Procfile)."""

from django.conf import settings
from rq import cron

from billing import tasks as billing_tasks
from console import pools, subscriptions
from jobs import tasks as job_tasks
from jobs.events import outbox
from monitoring import idle as monitoring_idle
from monitoring import tasks as monitoring_tasks

cron.register(job_tasks.hosts_check_all, "default", interval=settings.SUANLI_HOST_CHECK_INTERVAL)
# Placement also runs on every change that frees or asks for capacity; this is the safety net.
cron.register(job_tasks.place_pending, "default", interval=settings.SUANLI_PLACEMENT_INTERVAL)
cron.register(job_tasks.clusters_release_idle, "default", interval=60)
cron.register(job_tasks.clusters_release_stopped, "default", interval=60)
cron.register(job_tasks.image_builds_sweep, "default", interval=300)
cron.register(job_tasks.reconcile, "docker", interval=settings.SUANLI_RECONCILE_INTERVAL)
cron.register(job_tasks.dispatch_all, "default", interval=settings.SUANLI_RECONCILE_INTERVAL)
# Money: charge held capacity per second, every few seconds (billing/accrual.accrue).
cron.register(billing_tasks.accrue, "default", interval=settings.SUANLI_ACCRUAL_INTERVAL)
# Storage bought above the free part: one line per account and hour, once the hour has
# ended (billing/storage.py); looked at every minute, so an hour is charged within one.
cron.register(billing_tasks.storage_accrue, "default", interval=60)
# Every researcher's quota written again from what they bought (whatever wrote it last), and
# the space of files deleted while open (under no quota) looked at (jobs/files/storage.py upkeep).
cron.register(job_tasks.storage_upkeep, "default", interval=3600)
cron.register(job_tasks.storage_orphans_guard, "default", interval=60)
# Metrics: minute rollups of finished minutes, and retention (monitoring/tasks.py).
cron.register(monitoring_tasks.rollup_and_prune, "default", interval=60)
# Scheduled and idle shutdown (定时关机): stops at their time, and after N minutes of idle GPUs
# by the samples (monitoring/idle.py, jobs/clusters/shutdown.py).
cron.register(monitoring_idle.clusters_shutdown, "default", interval=60)
# Webhooks: deliveries that are due and whose enqueue was lost (jobs/events/webhooks.py).
cron.register(job_tasks.webhooks_sweep, "webhooks", interval=10)
# Follow-up work (a job's next dispatch, its profile summary...) whose queueing after its
# commit failed, Redis being away: sent once it answers (jobs/events/outbox.py).
cron.register(job_tasks.outbox_flush, "default", interval=outbox.FLUSH_S)
# Balance warnings (billing/services.notify_low_balances): every minute, so the 30-minute
# warning (balance.critical) leaves 29 minutes or more to top up.
cron.register(billing_tasks.notify_low_balances, "default", interval=60)
# Pools: money figures from billing, then each pool's autoscaler round; sweeps' safety net.
cron.register(pools.tick, "default", interval=settings.SUANLI_POOL_INTERVAL)
# GPU subscriptions: expire and fire (jobs/pools/subscriptions.py); GPUs coming back queue one too.
cron.register(subscriptions.tick, "default", interval=settings.SUANLI_GPU_SUBSCRIPTIONS_INTERVAL)
