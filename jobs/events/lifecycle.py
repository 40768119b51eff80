"""State changes of hosts, clusters and jobs that several parts make: a host found
unhealthy, a cluster released, preempted or back in the queue, written in the caller's
transaction with the timeline entries that say so (through `timeline`, the one writer).

Layer: events, under every package that changes a cluster's, a job's or a host's state
(clusters, hosts, runs, placement, pools); uses outbox, timeline, models and base (text). Work
of the packages above (a placement pass, a job's dispatch, stop or preemption) is asked for by
task name through `outbox` (queued once the transaction commits, kept until Redis took it),
never by importing them.
"""

import logging

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.queue import enqueue_many_unique
from jobs.base.text import Text, argument, stored_reason, twin_fields
from jobs.events.outbox import enqueue_after_commit
from jobs.events.timeline import cluster_event, job_event, reason_fields, set_reason
from jobs.models import Cluster, Host, Job, Node, WorkspaceApp

log = logging.getLogger(__name__)

# -- work for the parts above, after commit (kept until Redis took it: outbox) ---------------


def request_placement() -> None:
    """Run a placement pass after this transaction commits (deduplicated)."""
    enqueue_after_commit(
        "default", "jobs.tasks.place_pending", job_id="place-pending", again_if_running=True,
        result_ttl=60,
    )  # fmt: skip


def request_subscriptions_check() -> None:
    """Check the GPU subscriptions after this transaction commits (GPUs came back;
    deduplicated): by name, it runs in the console (jobs/pools/subscriptions.py rents with
    the balance check of billing, which sits above jobs)."""
    enqueue_after_commit(
        "default", "console.subscriptions.tick", job_id="gpu-subscriptions",
        again_if_running=True, result_ttl=60,
    )  # fmt: skip


# A cluster's dispatch task (`request_dispatch`, `request_dispatches`): deduplicated by
# `dispatch-<cluster id>`, queued again if running (it must see the jobs queued after it
# started).
DISPATCH_QUEUE, DISPATCH_TASK, DISPATCH_AGAIN = "docker", "jobs.tasks.cluster_dispatch", True


def _dispatch_id(cluster_id: int) -> str:
    return f"dispatch-{cluster_id}"


def request_dispatch(cluster_id: int) -> None:
    """Start the cluster's next queued job once this transaction commits."""
    enqueue_after_commit(
        DISPATCH_QUEUE, DISPATCH_TASK, cluster_id, job_id=_dispatch_id(cluster_id),
        again_if_running=DISPATCH_AGAIN,
    )  # fmt: skip


def request_dispatches(cluster_ids: list[int]) -> None:
    """`request_dispatch` of many clusters (a cron round of the pools), sent together once
    this transaction commits. Not kept in the outbox: the next round, seconds later, asks
    again, so a Redis that is away is only logged."""
    if not cluster_ids:
        return
    calls = [((pk,), _dispatch_id(pk)) for pk in cluster_ids]

    def send() -> None:
        try:
            enqueue_many_unique(
                DISPATCH_QUEUE, DISPATCH_TASK, calls, again_if_running=DISPATCH_AGAIN
            )
        except Exception as exc:  # Redis away: the next round asks again
            log.warning("could not queue %d dispatch(es): %s", len(calls), exc)

    transaction.on_commit(send)


def request_stop(job_id: int) -> None:
    """Stop the job's replicas (SIGTERM, then SIGKILL) once this transaction commits."""
    enqueue_after_commit("docker", "jobs.tasks.job_stop", job_id, job_id=f"stop-{job_id}")


# -- hosts ------------------------------------------------------------------------------------


def host_error_fields(message: str | Text) -> dict:
    """A host's last error, both ways it is kept: `last_error` in English (the API, join.sh;
    cut to what the field keeps) and `last_error_text` (a Text's JSON, shown in the reader's
    language; None for plain words, e.g. the engine's). Every writer of a host's last error
    uses this, so the Hosts page (Host.last_error_shown) never shows an older reason than
    the English one."""
    return twin_fields(Host, "last_error", message)


def host_unhealthy(*, host: Host, state: str, message: str | Text, at=None) -> Host:
    """Record that a host is down (no answer) or degraded (cannot start containers, or a
    proof of the host check failed): out of placement from now. The first time in a spell,
    its clusters hear of it, and nodes on a down host stop being charged (`Node.lost_at`);
    placement moves them later (`stranded.move_stranded`). `message`: the engine's words,
    or a Text shown in the reader's language (Host.last_error_text)."""
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host.pk)
        at = at or timezone.now()
        was = host.state
        fields = {
            "state": state,
            "last_checked": at,
            **host_error_fields(message),
        }
        if was not in Host.UNHEALTHY:
            fields["unhealthy_since"] = at
        Host.objects.filter(pk=host.pk).update(**fields)
        if state == Host.State.DOWN:
            host_outage_began(host_id=host.pk, at=at)
        if state == Host.State.DOWN:
            Node.objects.filter(host=host, released_at__isnull=True, lost_at__isnull=True).update(
                lost_at=at
            )
        if was != state:
            what = Text(
                gettext_noop("host %(host)s stopped answering; not charged for its nodes from now")
                if state == Host.State.DOWN
                else gettext_noop(
                    "host %(host)s could not start containers; work moves to another host"
                ),
                host=host.name,
            )
            for cluster in Cluster.objects.filter(
                node_set__host=host, node_set__released_at__isnull=True
            ).distinct():
                cluster_event(cluster, "host-" + state, what, at=at)
        host.refresh_from_db()
    request_placement()  # degraded: move its clusters now; down: when it stays down
    return host


def host_outage_began(*, host_id: int, at=None) -> None:
    """The console lost the engine (its events stream broke): an outage begins, unless one
    is already open. Containers that end within it were ended by the engine."""
    at = at or timezone.now()
    Host.objects.filter(pk=host_id).filter(
        models.Q(outage_from__isnull=True) | models.Q(outage_to__isnull=False)
    ).update(outage_from=at, outage_to=None)


def host_outage_ended(*, host_id: int, at=None) -> None:
    """The engine answers again: the open outage, if any, ends now."""
    Host.objects.filter(pk=host_id, outage_from__isnull=False, outage_to__isnull=True).update(
        outage_to=at or timezone.now()
    )


# -- clusters ---------------------------------------------------------------------------------


def rehome_pool_jobs(cluster: Cluster) -> int:
    """A pool cluster going away: the pool's jobs waiting on it wait on another of the
    pool's clusters instead (cancelled with it only when the pool has no other)."""
    others = list(
        Cluster.objects.filter(
            pool_id=cluster.pool_id,
            state__in=(Cluster.State.PENDING, Cluster.State.RUNNING, Cluster.State.PREEMPTING),
            no_gpu=False,
        )
        .exclude(pk=cluster.pk)
        .order_by("created_at", "id")
    )
    # A running one first (it, or the first of them to be free, takes them).
    others.sort(key=lambda c: c.state != Cluster.State.RUNNING)
    other = others[0] if others else None
    if other is None:
        return 0
    moved = 0
    for job in cluster.jobs.filter(state__in=Job.WAITING, pool_id=cluster.pool_id):
        if Job.objects.filter(pk=job.pk, cluster_id=cluster.pk, state=job.state).update(
            cluster_id=other.pk
        ):
            job_event(
                job, "moved", Text(gettext_noop("waits on %(cluster)s instead"), cluster=other.name)
            )
            moved += 1
    if moved:
        request_dispatch(other.pk)
    return moved


def cancel_jobs_of(cluster: Cluster, reason: str | Text) -> None:
    """Queued jobs end now; running ones are stopped (their containers get SIGTERM)."""
    now = timezone.now()
    for job in cluster.jobs.filter(state__in=Job.WAITING):
        Job.objects.filter(pk=job.pk).update(
            state=Job.State.CANCELLED, finished_at=now, **reason_fields(Job, reason)
        )
        job_event(job, "cancelled", reason, at=now)
    for job in cluster.jobs.filter(state__in=Job.ACTIVE):
        Job.objects.filter(pk=job.pk).update(cancel_requested=True, **reason_fields(Job, reason))
        job_event(job, "cancelling", reason, at=now)
        request_stop(job.pk)


def free_nodes(nodes, now) -> int:
    """The nodes end at `now` (their charge stops there) but keep holding their GPU slots:
    a process of theirs may still run on those GPUs, with its memory, until the engine
    confirms their containers are gone or stopped (`workspaces.free_gpus`, run by the
    removal and stop tasks, a replica's end and the reconciler). Placement skips a slot
    while it is held (`GpuSlot.node` set), so no other tenant gets it before then."""
    return Node.objects.filter(pk__in=[n.pk for n in nodes]).update(released_at=now)


BY_OWNER = Text(gettext_noop("released by its owner"))


@transaction.atomic
def cluster_release(
    *, cluster: Cluster, reason: str | Text = BY_OWNER, failed: bool = False
) -> Cluster:
    """Release the cluster: its charge stops at this second, its GPUs go back once its
    containers are gone (`free_nodes`; the removal task queued here). Idempotent. With
    `failed`, it could not run (its image could not be pulled, its workspace not started):
    it ends as failed, `reason` its state reason and its timeline's last word."""
    cluster = Cluster.objects.select_for_update().get(pk=cluster.pk)
    if cluster.state in (Cluster.State.RELEASED, Cluster.State.FAILED):
        return cluster
    now = timezone.now()
    was_pending = cluster.state == Cluster.State.PENDING and cluster.stopped_at is None
    if not was_pending and not failed:
        cluster_event(cluster, "releasing", reason, at=now)
    if cluster.pool_id:
        rehome_pool_jobs(cluster)
    cancel_jobs_of(cluster, reason)
    live = list(cluster.node_set.filter(released_at__isnull=True))
    free_nodes(live, now)
    # A stopped cluster's kept workspaces go with it (and their stopped time ends).
    kept = cluster.node_set.filter(stopped_at__isnull=False, kept_until__isnull=True).update(
        kept_until=now
    )
    cluster.state = Cluster.State.FAILED if failed else Cluster.State.RELEASED
    said = set_reason(cluster, reason)
    cluster.released_at = now
    cluster.save(update_fields=["state", *said, "released_at"])
    cluster_event(
        cluster,
        "failed" if failed else "released",
        reason if was_pending or failed else Text(gettext_noop("capacity returned")),
        at=now,
    )
    WorkspaceApp.objects.filter(cluster=cluster).delete()  # they die with the workspaces
    if live or kept:
        request_placement()
        enqueue_after_commit(
            "docker", "jobs.tasks.cluster_network_remove", cluster.pk, job_id=f"net-rm-{cluster.pk}"
        )
    return cluster


# -- spot preemption --------------------------------------------------------------------------

# The state reasons of a preemption; the reason inside is said again further on (the job's
# "preempted ...", the cluster's place in the queue).
PREEMPTING = gettext_noop("preempting: %(reason)s")  # the cluster's
NOTICE = gettext_noop("preemption notice: %(reason)s")  # its running job's
PREEMPTED = gettext_noop("preempted (%(reason)s); waiting to be placed again")  # back in line


@transaction.atomic
def cluster_preempt(*, cluster: Cluster, reason: str | Text) -> bool:
    """Send a running spot cluster its preemption notice: billing stops at this second,
    the running job's replicas run its preemption script, then get SIGTERM and, after the
    grace period, SIGKILL; the cluster then goes back to the queue on its own
    (`cluster_requeue_preempted`). False when it is not a running spot cluster (any more)."""
    cluster = Cluster.objects.select_for_update().get(pk=cluster.pk)
    if not cluster.spot or cluster.state != Cluster.State.RUNNING:
        return False
    now = timezone.now()
    Cluster.objects.filter(pk=cluster.pk).update(
        state=Cluster.State.PREEMPTING,
        **reason_fields(Cluster, Text(PREEMPTING, reason=reason)),
    )
    Node.objects.filter(cluster=cluster, released_at__isnull=True).update(preempted_at=now)
    cluster_event(
        cluster,
        "preempting",
        Text(gettext_noop("%(reason)s; not charged from now until it runs again"), reason=reason),
        at=now,
    )
    active = cluster.jobs.filter(state__in=Job.ACTIVE).first()
    if active is None:
        transaction.on_commit(lambda: cluster_requeue_preempted(cluster_id=cluster.pk))
        return True
    if active.stop_requested_at is not None:
        # Already stopping (a failed rank, a cancel): it ends as what it is, not preempted;
        # the cluster goes back to the queue when it has.
        return True
    Job.objects.filter(pk=active.pk).update(
        preempt_requested_at=now,
        **reason_fields(Job, Text(NOTICE, reason=reason)),
    )
    notice = Text(
        gettext_noop(
            "preemption notice: %(reason)s; running its preemption script (limit %(limit)s s), "
            "then SIGTERM, SIGKILL after %(grace)s s"
        )
        if active.preemption_script.strip()
        else gettext_noop(
            "preemption notice: %(reason)s; no preemption script (limit %(limit)s s), "
            "then SIGTERM, SIGKILL after %(grace)s s"
        ),
        reason=reason,
        limit=settings.SUANLI_PREEMPT_SCRIPT_S,
        grace=settings.SUANLI_PREEMPT_GRACE_S,
    )
    job_event(active, "notice", notice, at=now)
    job_id = active.pk
    enqueue_after_commit("docker", "jobs.tasks.job_preempt", job_id, job_id=f"preempt-{job_id}")
    return True


@transaction.atomic
def cluster_requeue_preempted(*, cluster_id: int) -> bool:
    """A preempting cluster whose job has left its nodes gives their GPUs back and waits in
    the queue again, behind what is already waiting. Idempotent."""
    cluster = Cluster.objects.select_for_update().filter(pk=cluster_id).first()
    if cluster is None or cluster.state != Cluster.State.PREEMPTING:
        return False
    if cluster.jobs.filter(state__in=Job.ACTIVE).exists():
        return False  # its replicas are still stopping
    now = timezone.now()
    live = list(cluster.node_set.filter(released_at__isnull=True))
    free_nodes(live, now)
    said = stored_reason(cluster)
    reason = argument(said, PREEMPTING)
    if reason is None:  # plain words (a row from before their twin)
        reason = str(said).removeprefix("preempting: ")
    Cluster.objects.filter(pk=cluster.pk).update(
        state=Cluster.State.PENDING,
        **reason_fields(Cluster, Text(PREEMPTED, reason=reason)),
        queued_at=now,
        running_since=None,
    )
    cluster_event(
        cluster,
        "preempted",
        Text(gettext_noop("capacity returned; back in the queue, placed again when it fits")),
        at=now,
    )
    if cluster.pool_id:
        # A pool's cluster back in the queue: its waiting jobs wait on a sibling instead, a
        # free running one first, which takes them at once.
        rehome_pool_jobs(cluster)
    request_placement()
    # Its GPUs go to others once its workspaces are gone (free_nodes).
    enqueue_after_commit(
        "docker", "jobs.tasks.cluster_nodes_ended", cluster.pk, job_id=f"ended-{cluster.pk}"
    )
    return True
