"""Repair after a crash (`reconcile`, every minute): compare the database with what the
engines report, by label, and mend what a dead worker, a lost task or a down engine left
behind: replicas adopted, finalised or lost, leftovers removed, stuck starts run again,
overdue jobs and stops killed, preemptions and settles followed up.

Layer: runs, the top of it (the reconciler); uses dispatch, exits, settle, stopping, shared,
nodes (engine, network, runtime, workspaces), events (lifecycle, timeline), models and base
(queue, text).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import django_rq
import docker
from django.conf import settings
from django.utils import timezone
from django.utils.translation import gettext_noop
from rq.registry import StartedJobRegistry

from jobs.base.queue import enqueue_unique
from jobs.base.text import Text
from jobs.events import lifecycle
from jobs.events.timeline import job_event, reason_fields
from jobs.models import Cluster, Host, Job, Node, Replica
from jobs.nodes import engine, network, runtime, workspaces
from jobs.runs.dispatch import adopt
from jobs.runs.exits import free_gpus, replica_exited, replica_lost
from jobs.runs.settle import settle
from jobs.runs.shared import enqueue
from jobs.runs.stopping import grace, send_signal, stop

log = logging.getLogger(__name__)


def _settle_abandoned_rq_jobs() -> int:
    """RQ jobs whose worker died stay "started" until their heartbeat lapses; move them to
    the failed registry now. Their domain state (a job left STARTING, a replica without a
    container) is repaired below from the database, not by re-running the RQ job."""
    count = 0
    for name in ("docker", "default", "webhooks"):
        queue = django_rq.get_queue(name)
        registry = StartedJobRegistry(queue=queue)
        before = registry.count
        registry.cleanup()
        count += max(0, before - registry.count)
    return count


def reconcile(*, stuck_after_s: int = 60) -> dict:
    """Compare the database with what the engines report, by label, and repair."""
    report = {"finalised": 0, "lost": 0, "removed": 0, "restarted": 0}
    now = timezone.now()
    report["abandoned_rq_jobs"] = _settle_abandoned_rq_jobs()
    live = Replica.objects.filter(
        state__in=[Replica.State.RUNNING, Replica.State.CREATING]
    ).select_related("host", "job")
    by_host: dict[int, list[Replica]] = {}
    for replica in live:
        by_host.setdefault(replica.host_id, []).append(replica)
    stuck: set[int] = set()
    for host in Host.objects.exclude(state=Host.State.DOWN):
        _reconcile_host(host, by_host.get(host.pk, []), now, stuck_after_s, report, stuck)
    _stop_overdue_jobs(now, report)
    _lose_replicas_of_down_hosts(by_host, report)
    report["restarted"] = len(stuck)
    for job_id in stuck:
        enqueue("jobs.tasks.job_start", job_id, job_id=f"start-{job_id}")
    report["workspaces_made"] = _ensure_missing_workspaces(now)
    report["killed"] = _kill_overdue_stops(now)
    report["preemptions"] = _follow_preemptions()
    report["settled"] = _settle_orphans()
    # The safety net of a release or stop whose task gave up (an engine that was down):
    # GPUs still held by ended nodes go back once their engines confirm.
    report["gpus_freed"] = free_gpus()
    return report


def _reconcile_host(
    host: Host, replicas: list[Replica], now, stuck_after_s: int, report: dict, stuck: set[int]
) -> None:
    """One answering host: its leftover workspaces and networks swept, its live replicas
    compared with their containers (adopted, finalised or lost; a start stuck for longer
    than `stuck_after_s` noted in `stuck`), and labelled containers of no live replica
    removed."""
    try:
        containers = engine.cached_client(host).containers.list(
            ignore_removed=True, all=True, filters=runtime.replica_labels_filter()
        )
    except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
        log.warning("reconcile: %s unreachable: %s", host.name, exc)
        return
    report["workspaces_removed"] = report.get("workspaces_removed", 0) + workspaces.sweep(
        host, engine.cached_client(host)
    )
    report["networks_removed"] = report.get("networks_removed", 0) + network.sweep(
        host, engine.cached_client(host)
    )
    by_name = {c.name: c for c in containers}
    for replica in replicas:
        container = by_name.pop(replica.container_name, None)
        if (
            replica.state == Replica.State.CREATING
            and container is not None
            and (container.status == "running")
        ):
            report["adopted"] = report.get("adopted", 0) + 1
            adopt(replica, container)
            continue
        if replica.state == Replica.State.CREATING and (
            container is None or container.status == "created"
        ):
            if (
                replica.job.state == Job.State.STARTING
                and (now - replica.job.started_at).total_seconds() > stuck_after_s
            ):
                # The worker that was starting it died (before or after `create`):
                # start again, once, on a worker (start_replicas is idempotent).
                stuck.add(replica.job_id)
            continue
        if container is None:
            report["lost"] += 1
            replica_lost(
                replica.pk,
                Text(gettext_noop("its container is gone from %(host)s"), host=host.name),
            )
        elif container.status in ("exited", "dead"):
            report["finalised"] += 1
            replica_exited(replica.pk, exit_code=container.attrs["State"]["ExitCode"])
    report["removed"] += _remove_leftovers(by_name.values())


def _remove_leftovers(containers) -> int:
    """Labelled containers with no live replica: leftovers (finalised, or from a lost
    attempt). Each is looked up again first: a replica created after the caller's query is
    not a leftover."""
    count = 0
    for container in containers:
        if Replica.objects.filter(
            container_name=container.name,
            state__in=[Replica.State.RUNNING, Replica.State.CREATING],
        ).exists():
            continue
        try:
            container.remove(force=True, v=True)
            count += 1
        except docker.errors.DockerException:
            pass
    return count


def _stop_overdue_jobs(now, report: dict) -> None:
    """Running jobs past their maximum runtime: cancelled, with the reason, and stopped."""
    overdue = Job.objects.filter(
        state=Job.State.RUNNING, max_runtime_s__isnull=False, cancel_requested=False
    ).only("pk", "running_since", "max_runtime_s")
    for job in overdue:
        if job.running_since and (now - job.running_since).total_seconds() > job.max_runtime_s:
            reason = Text(
                gettext_noop("stopped: ran past its maximum runtime of %(minutes)s min"),
                minutes=job.max_runtime_s // 60,
            )
            if Job.objects.filter(pk=job.pk, cancel_requested=False).update(
                cancel_requested=True, **reason_fields(Job, reason)
            ):
                job_event(job.pk, "timeout", reason)
                report["timed_out"] = report.get("timed_out", 0) + 1
                stop(job.pk)


def _lose_replicas_of_down_hosts(by_host: dict[int, list[Replica]], report: dict) -> None:
    """Live replicas on hosts that are down: lost, not by the job's fault."""
    for host in Host.objects.filter(state=Host.State.DOWN, pk__in=list(by_host)):
        for replica in by_host[host.pk]:
            report["lost"] += 1
            replica_lost(
                replica.pk,
                Text(
                    gettext_noop("host %(host)s stopped answering (not the job's failure)"),
                    host=host.name,
                ),
                host_fault=True,
            )


def _ensure_missing_workspaces(now) -> int:
    """Nodes placed a while ago whose workspace was not made (an engine that refused, a
    lost task): queue the task again (never inline: an image pull must not hold up the
    reconciler's other work)."""
    clusters = set(
        Node.objects.filter(
            released_at__isnull=True, lost_at__isnull=True, workspace_container="",
            cluster__state=Cluster.State.RUNNING, cluster__workspace=True,
            placed_at__lt=now - timedelta(seconds=30),
        ).values_list("cluster_id", flat=True)
    )  # fmt: skip
    for cluster_id in clusters:
        enqueue("jobs.tasks.cluster_network_ensure", cluster_id, job_id=f"net-{cluster_id}")
    return len(clusters)


def _kill_overdue_stops(now) -> int:
    """The SIGKILL after the grace period is a delayed RQ job; if it was lost (no
    scheduler, a Redis flush), containers of a stopped job must not outlive it, least of
    all on capacity a release already gave back."""
    count = 0
    for preempting in (False, True):
        deadline = now - timedelta(seconds=grace(preempting) + 5)
        for replica in Replica.objects.filter(
            state=Replica.State.RUNNING,
            job__stop_requested_at__lt=deadline,
            job__preempt_requested_at__isnull=not preempting,
        ).select_related("host"):
            send_signal(replica, "SIGKILL")
            count += 1
    return count


def _follow_preemptions() -> int:
    """The safety net of preemption: notices whose follow-up was lost, and preempting
    clusters whose jobs have all left (a requeue lost to a crash)."""
    count = 0
    # Only past the script's limit: before it, the notice's own follow-up is still going.
    overdue = timezone.now() - timedelta(seconds=settings.SUANLI_PREEMPT_SCRIPT_S + 5)
    for job_id in Job.objects.filter(
        state__in=Job.ACTIVE,
        preempt_requested_at__lt=overdue,
        stop_requested_at__isnull=True,
    ).values_list("pk", flat=True):
        enqueue_unique("docker", "jobs.tasks.job_preempt", job_id, job_id=f"preempt-{job_id}")
        count += 1
    for cluster_id in (
        Cluster.objects.filter(state=Cluster.State.PREEMPTING)
        .exclude(jobs__state__in=Job.ACTIVE)
        .values_list("pk", flat=True)
    ):
        lifecycle.cluster_requeue_preempted(cluster_id=cluster_id)
        count += 1
    return count


def _settle_orphans() -> int:
    """Active jobs whose replicas have all ended but whose settle never ran (the process
    died between recording the last exit and deciding the job)."""
    count = 0
    for job in Job.objects.filter(state__in=Job.ACTIVE).only("pk", "attempt"):
        replicas = Replica.objects.filter(job_id=job.pk, attempt=job.attempt)
        if (
            replicas.exists()
            and not replicas.filter(
                state__in=[Replica.State.CREATING, Replica.State.RUNNING]
            ).exists()
        ):
            settle(job.pk)
            count += 1
    return count
