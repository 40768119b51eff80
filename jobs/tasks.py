"""Thin RQ entry points: take ids, call a service."""

from datetime import timedelta

import django_rq
from rq.job import JobStatus

from jobs import network, services
from jobs.models import Cluster, Host

_PENDING = {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED}


def enqueue_unique(queue_name: str, func, *args, job_id: str, again_if_running=False, **options):
    """Enqueue unless a job with this id is still waiting (RQ itself would overwrite it and
    queue it twice). With `again_if_running`, a job that is already running gets one
    follow-up queued behind it, for work that must see what changed after it started."""
    queue = django_rq.get_queue(queue_name)
    for candidate in (job_id, f"{job_id}-next") if again_if_running else (job_id,):
        existing = queue.fetch_job(candidate)
        status = existing.get_status(refresh=True) if existing is not None else None
        if status in _PENDING - {JobStatus.STARTED}:
            return existing
        if status == JobStatus.STARTED:
            if again_if_running:
                continue
            return existing
        return queue.enqueue(func, *args, job_id=candidate, **options)
    return None


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


def place_pending() -> int:
    from jobs import scheduler

    return len(scheduler.place_pending().placed)


def clusters_release_idle() -> int:
    return len(services.clusters_release_idle())


def cluster_dispatch(cluster_id: int) -> int | None:
    from jobs import runner

    return runner.dispatch(cluster_id)


def cluster_network_ensure(cluster_id: int) -> str | None:
    """After placement: the cluster's network, so that its first job starts on one."""
    if not Cluster.objects.filter(pk=cluster_id, state=Cluster.State.RUNNING).exists():
        return None
    try:
        return network.ensure(cluster_id)
    except network.NetworkError as exc:
        return f"not made: {exc}"  # the job start tries again and says why it fails


def cluster_network_remove(cluster_id: int, tries: int = 0) -> bool:
    """After release: remove the cluster's networks once its containers are gone; try
    again a little later while they are stopping (the reconciler sweeps what is left)."""
    if network.remove(cluster_id):
        return True
    if tries < 5:
        django_rq.get_queue("docker").enqueue_in(
            timedelta(seconds=10 * (tries + 1)), cluster_network_remove, cluster_id, tries + 1
        )
    return False


def job_start(job_id: int) -> None:
    from jobs import runner

    runner.start_replicas(job_id)


def job_stop(job_id: int) -> None:
    from jobs import runner

    runner.stop(job_id)
    runner.settle(job_id)


def job_preempt(job_id: int) -> None:
    from jobs import runner

    runner.preempt(job_id)


def job_kill(job_id: int, attempt: int | None = None) -> None:
    from jobs import runner

    runner.kill(job_id, attempt)


def replica_exited(replica_id: int, exit_code: int | None = None) -> None:
    from jobs import runner

    runner.replica_exited(replica_id, exit_code=exit_code)


def reconcile() -> dict:
    from jobs import runner

    return runner.reconcile()


def dispatch_all() -> int:
    """Safety net: every running cluster with queued work and nothing active gets a dispatch."""
    from jobs.models import Cluster, Job

    ids = list(
        Cluster.objects.filter(state=Cluster.State.RUNNING, jobs__state__in=Job.WAITING)
        .exclude(jobs__state__in=Job.ACTIVE)
        .values_list("pk", flat=True)
        .distinct()
    )
    for cluster_id in ids:
        enqueue_unique(
            "docker",
            cluster_dispatch,
            cluster_id,
            job_id=f"dispatch-{cluster_id}",
            again_if_running=True,
        )
    return len(ids)


def webhook_deliver(delivery_id: int) -> str:
    from jobs import webhooks

    return webhooks.deliver(delivery_id)


def webhooks_sweep() -> int:
    from jobs import webhooks

    return webhooks.sweep()
