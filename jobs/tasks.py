"""Thin RQ entry points: take ids, call a part below.

Layer: tasks, the top of jobs/ (beside admin, management and apps). Uses pools, clusters,
hosts, images, runs, nodes, placement, events, files, models and base. The packages below queue
these by their dotted name ("jobs.tasks.cluster_dispatch") through `jobs.base.queue`, never by
importing this module.
"""

from jobs.base import metrics
from jobs.base.queue import enqueue_later, enqueue_unique
from jobs.clusters import services
from jobs.events import outbox, webhooks
from jobs.files import storage
from jobs.hosts import services as host_services
from jobs.images import builds
from jobs.models import Cluster, Host, Job
from jobs.nodes import network, workspaces
from jobs.placement import scheduler
from jobs.pools import autoscaler, sweeps
from jobs.runs import dispatch, exits, preemption, progress, repair, settle, stopping


def host_check(host_id: int) -> str:
    return host_services.host_check(host_id=host_id).state


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
    with metrics.timed(metrics.PLACEMENT_PASS):
        return len(scheduler.place_pending().placed)


def clusters_release_idle() -> int:
    return len(services.clusters_release_idle())


def cluster_dispatch(cluster_id: int) -> int | None:
    """The cluster's next job started, with others ready beside it (dispatch.dispatch_ready)."""
    return dispatch.dispatch_ready(cluster_id)


def cluster_network_ensure(cluster_id: int) -> str | None:
    """After placement, a move or a resize: the cluster's network, so that its first job
    starts on one, and a workspace on each node (the reconciler retries one that failed)."""
    if not Cluster.objects.filter(pk=cluster_id, state=Cluster.State.RUNNING).exists():
        return None
    try:
        name = network.ensure(cluster_id)
    except network.NetworkError as exc:
        return f"not made: {exc}"  # the job start tries again and says why it fails
    failed = workspaces.ensure(cluster_id)
    exits.free_gpus(cluster_id=cluster_id)  # of nodes a resize or a move left behind
    return name + "".join(f"; workspace {i}: {why}" for i, why in failed.items())


def cluster_network_remove(cluster_id: int, tries: int = 0) -> bool:
    """After release: remove the cluster's workspaces, give its GPUs back once the engines
    confirm its containers are gone, then its networks; try again a little later while
    they are stopping (the reconciler sweeps what is left and frees what it can)."""
    gone = workspaces.remove(cluster_id)
    exits.free_gpus(cluster_id=cluster_id)
    held = workspaces.gpus_held(cluster_id)
    if network.remove(cluster_id) and gone and not held:
        return True
    if tries < 5:
        enqueue_later(cluster_network_remove, cluster_id, tries + 1, delay_s=10 * (tries + 1))
    return False


def cluster_nodes_ended(cluster_id: int, tries: int = 0) -> bool:
    """After a preemption: the ended nodes' workspaces removed, then their GPUs given back
    once the engines confirm; tried again a little later while they stop (the
    reconciler's sweep is the safety net)."""
    workspaces.remove_ended(cluster_id)
    exits.free_gpus(cluster_id=cluster_id)
    if not workspaces.gpus_held(cluster_id):
        return True
    if tries < 5:
        enqueue_later(cluster_nodes_ended, cluster_id, tries + 1, delay_s=10 * (tries + 1))
    return False


def cluster_workspaces_stop(cluster_id: int, tries: int = 0) -> bool:
    """After a stop: the kept workspaces stopped on their hosts, then the cluster's GPUs
    given back (nothing of it runs on them any more); tried again a little later while an
    engine does not answer or a job's replicas are still stopping (the reconciler's sweep
    also stops them, and frees what it can)."""
    stopped = workspaces.stop(cluster_id)
    exits.free_gpus(cluster_id=cluster_id)
    if stopped:  # the GPUs first: nothing waits on the save
        enqueue_unique(
            "builds",  # the builder's: a long push holds up no start, stop or accrual
            cluster_workspaces_save,
            cluster_id,
            job_id=f"ws-save-{cluster_id}",
            job_timeout=workspaces.save_timeout(cluster_id),
        )
    if stopped and not workspaces.gpus_held(cluster_id):
        return True
    if tries < 5:
        enqueue_later(cluster_workspaces_stop, cluster_id, tries + 1, delay_s=10 * (tries + 1))
    return False


def cluster_workspaces_restart(cluster_id: int, tries: int = 0) -> bool:
    """A team member left with "restart": the cluster's running workspaces restarted (files
    kept), so that nothing they left running outlives them; tried again while an engine does
    not answer."""
    if workspaces.restart(cluster_id):
        return True
    if tries < 5:
        enqueue_later(cluster_workspaces_restart, cluster_id, tries + 1, delay_s=10 * (tries + 1))
    return False


def cluster_workspaces_save(cluster_id: int, tries: int = 0) -> bool:
    """After a stop: the kept workspaces' root filesystems pushed to the registry, so that
    the cluster can start on another host when its own has no room; tried again a little
    later while an engine or the registry does not answer (a start that needs a save
    missing queues this again). On the queue "builds" (the builder's workers): a push of a
    large system disk may take SUANLI_WORKSPACE_SAVE_S."""
    if workspaces.save(cluster_id):
        return True
    if tries < 5:
        enqueue_later(
            cluster_workspaces_save,
            cluster_id,
            tries + 1,
            delay_s=30 * (tries + 1),
            queue="builds",
            job_timeout=workspaces.save_timeout(cluster_id),
        )
    return False


def clusters_release_stopped() -> dict:
    return services.clusters_release_stopped()


def job_start(job_id: int) -> None:
    dispatch.start_replicas(job_id)


def job_stop(job_id: int) -> None:
    stopping.stop(job_id)
    settle.settle(job_id)


def job_preempt(job_id: int) -> None:
    preemption.preempt(job_id)


def job_kill(job_id: int, attempt: int | None = None) -> None:
    stopping.kill(job_id, attempt)


def replica_exited(replica_id: int, exit_code: int | None = None) -> None:
    exits.replica_exited(replica_id, exit_code=exit_code)


def reconcile() -> dict:
    return repair.reconcile()


def dispatch_all() -> int:
    """Safety net: every running cluster with queued work and nothing active gets a dispatch."""
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
    outcome = webhooks.deliver(delivery_id)
    if outcome in ("gave up", "gone", "disabled"):  # its last attempt failed
        metrics.inc(metrics.WEBHOOK_FAILURES)
    return outcome


def webhooks_sweep() -> int:
    return webhooks.sweep()


def outbox_flush() -> int:
    """Follow-up work a commit could not queue (Redis was away): jobs/events/outbox.py."""
    return outbox.flush()


def image_build_run(build_id: int) -> str:
    """One build or workspace save (queue "builds")."""
    return builds.run(build_id)


def image_builds_sweep() -> int:
    return builds.sweep_stuck()


def image_forget_local(reference: str, host_id: int | None = None) -> int:
    """A deleted own image off the engines that have it, or a dead build's tag off its
    host (queue "builds")."""
    return builds.forget_local(reference, host_id)


# -- pools and sweeps (jobs/pools/autoscaler.py, jobs/pools/sweeps.py) ---------------------------------------


def pool_scale(pool_id: int) -> str:
    return autoscaler.pool_scale(pool_id)


def sweep_observe(job_id: int) -> str:
    """Queued by the live log follower when a job printed a SUANLI_METRIC line."""
    return sweeps.observe(job_id)


def sweep_job_ended(job_id: int) -> str:
    """Queued by the runner when a pool's job ended: a sweep's trial makes room."""
    return sweeps.job_ended(job_id)


def job_progress(job_id: int) -> str:
    """Queued by the live log follower when a job printed a SUANLI_METRIC line (its step,
    for its pace: jobs/runs/progress.py)."""
    return progress.observe(job_id)


def job_progress_ended(job_id: int) -> str:
    """Queued by the runner when a job ended: its last lines, read in full (the pace's
    last point, for the projected-against-actual comparison)."""
    return progress.observe(job_id, full=True)


def sweeps_tick() -> int:
    return sweeps.tick()


def storage_orphans_guard() -> dict:
    """Every minute (MooseFS): when files deleted while still open hold more than
    SUANLI_STORAGE_SUSTAINED_MAX_GB (space no quota counts), the running clusters of the
    researchers whose processes hold such files are stopped (their files kept; released
    when they keep no workspace), which closes them and frees the space
    (services.clusters_stop_for_orphans)."""
    return services.clusters_stop_for_orphans()


def storage_upkeep() -> dict:
    """Hourly (jobs/files/storage.py upkeep): every researcher's quota written again from what they
    bought, and the space deleted-but-open files hold looked at."""
    report = storage.upkeep()
    found = report.orphans
    return {
        "applied": report.applied,
        "failed": report.failed,
        "sustained_bytes": found.sustained_bytes if found else None,
        "over": found.over if found else None,
        "error": report.error,
    }
