"""Thin RQ entry points: take ids, call a service."""

import django_rq
from rq.job import JobStatus

from jobs import services
from jobs.models import Host

_PENDING = {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED}


def enqueue_unique(queue_name: str, func, *args, job_id: str, **options):
    """Enqueue unless a job with this id is still waiting or running (RQ itself would
    overwrite it and queue it twice)."""
    queue = django_rq.get_queue(queue_name)
    existing = queue.fetch_job(job_id)
    if existing is not None and existing.get_status(refresh=True) in _PENDING:
        return existing
    return queue.enqueue(func, *args, job_id=job_id, **options)


def host_check(host_id: int) -> str:
    return services.host_check(host_id=host_id).state


def hosts_check_all() -> int:
    """Periodic: queue one check per host so a slow engine delays only itself."""
    ids = list(Host.objects.values_list("pk", flat=True))
    for host_id in ids:
        enqueue_unique(
            "docker",
            host_check,
            host_id,
            job_id=f"host-check-{host_id}",
            result_ttl=60,
            failure_ttl=3600,
        )
    return len(ids)
