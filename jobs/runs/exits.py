"""Following containers to their end: a replica's exit recorded (its code, its log, whether
its engine ended it) and its container removed, a lost replica, a host caught up on what
its watcher missed, and the lines of a running replica's log.

Layer: runs, over settle; uses settle, nodes (engine, runtime, workspaces), events (lifecycle,
timeline), models and base (text).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import docker
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Text
from jobs.events import lifecycle
from jobs.events.timeline import job_event
from jobs.models import Host, Job, Node, Replica
from jobs.nodes import engine, runtime, workspaces
from jobs.placement import fleet
from jobs.runs.settle import settle

log = logging.getLogger(__name__)


def _stored_log(container) -> str:
    try:
        raw = container.logs(stdout=True, stderr=True, timestamps=True)
    except docker.errors.DockerException:
        return ""
    text = raw.decode("utf-8", "replace")
    limit = settings.SUANLI_LOG_STORE_BYTES
    return text if len(text) <= limit else "[... earlier output dropped ...]\n" + text[-limit:]


def replica_exited(replica_id: int, *, exit_code: int | None = None) -> None:
    """Record a replica's end: exit code and log, then remove its container. Idempotent."""
    replica = Replica.objects.select_related("host").get(pk=replica_id)
    if replica.state in (Replica.State.EXITED, Replica.State.LOST):
        return
    container = None
    try:
        container = engine.cached_client(replica.host).containers.get(replica.container_name)
        if exit_code is None:
            container.reload()
            if container.status in ("running", "created", "restarting"):
                return  # not ended after all
            exit_code = container.attrs["State"]["ExitCode"]
    except docker.errors.NotFound:
        pass
    except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
        log.warning("replica %s: engine unreachable while finalising: %s", replica.pk, exc)
        return  # the reconciler tries again
    text = _stored_log(container) if container is not None else ""
    state = Replica.State.EXITED if exit_code is not None else Replica.State.LOST
    # The container's own end, whoever finalises it and however late (a watcher that was
    # down, the reconciler's next pass).
    finished = (
        engine.container_time(container.attrs.get("State", {}).get("FinishedAt"))
        if container is not None
        else None
    ) or timezone.now()
    host_fault = bool(exit_code) and _ended_by_engine(replica, finished)
    with transaction.atomic():
        updated = Replica.objects.filter(
            pk=replica.pk, state__in=[Replica.State.RUNNING, Replica.State.CREATING]
        ).update(
            state=state, exit_code=exit_code, finished_at=finished, log=text, host_fault=host_fault
        )
        if updated and host_fault:
            job_event(
                replica.job_id,
                "host-lost",
                Text(
                    gettext_noop(
                        "rank %(rank)s was stopped by its host %(host)s (the engine restarted "
                        "or stopped answering; exit code %(code)s): not the job's failure"
                    ),
                    rank=replica.rank,
                    host=replica.host.name,
                    code=exit_code,
                ),
            )
    if container is not None:
        try:
            container.remove(force=True, v=True)
        except docker.errors.DockerException:
            pass  # the reconciler removes leftovers
    if updated:
        settle(replica.job_id)
    if Node.objects.filter(
        pk=replica.node_id, released_at__isnull=False, slots__isnull=False
    ).exists():
        free_gpus(host_ids=[replica.host_id])  # its node ended while it ran: its GPUs go back


def free_gpus(**which) -> int:
    """Ended nodes' GPUs back once their engines confirm (workspaces.free_gpus); a
    placement pass when some came back, and a check of the GPU subscriptions."""
    freed = workspaces.free_gpus(**which)
    if freed:
        lifecycle.request_placement()
        lifecycle.request_subscriptions_check()
    return freed


# A container's end counts as its engine's doing when it falls in an outage of the
# engine, give or take this much (a stopping engine SIGTERMs its containers around the
# moment its API goes; a starting one kills what ran before it).
OUTAGE_SLACK = timedelta(seconds=10)


def _ended_by_engine(replica: Replica, finished) -> bool:
    """Whether a container that ended with a non-zero code was ended by its engine (a
    restart or crash of dockerd), not by the job: it ended within the engine's last outage
    as the console saw it, while nobody had asked the job to stop."""
    host = Host.objects.filter(pk=replica.host_id).values("outage_from", "outage_to").first()
    if not host or host["outage_from"] is None:
        return False
    if finished < host["outage_from"] - OUTAGE_SLACK:
        return False
    if host["outage_to"] is not None and finished > host["outage_to"] + OUTAGE_SLACK:
        return False
    return not Job.objects.filter(pk=replica.job_id, stop_requested_at__isnull=False).exists()


def replica_lost(replica_id: int, reason: str | Text, *, host_fault: bool = False) -> None:
    replica = Replica.objects.get(pk=replica_id)
    if Replica.objects.filter(
        pk=replica.pk, state__in=[Replica.State.RUNNING, Replica.State.CREATING]
    ).update(state=Replica.State.LOST, finished_at=timezone.now(), host_fault=host_fault):
        job_event(
            replica.job_id,
            "lost",
            Text(gettext_noop("rank %(rank)s: %(reason)s"), rank=replica.rank, reason=reason),
        )
        settle(replica.job_id)


def finalise_exited(host: Host) -> int:
    """Catch up on one host: finalise live replicas whose containers already exited (what
    a watcher that was not running missed)."""
    client = engine.cached_client(host)
    count = 0
    filters = {**runtime.replica_labels_filter(), "status": "exited"}
    for container in client.containers.list(ignore_removed=True, all=True, filters=filters):
        replica = Replica.objects.filter(
            container_name=container.name, state__in=[Replica.State.RUNNING, Replica.State.CREATING]
        ).first()
        if replica is not None:
            replica_exited(replica.pk, exit_code=container.attrs["State"]["ExitCode"])
            count += 1
    return count


def live_log_since(replica: Replica, since: float | None) -> list[str]:
    """Timestamped lines of a running replica's container, from `since` (UNIX seconds)."""
    try:
        container = engine.cached_client(replica.host).containers.get(replica.container_name)
        raw = (
            container.logs(stdout=True, stderr=True, timestamps=True, since=since)
            if since
            else container.logs(stdout=True, stderr=True, timestamps=True)
        )
    except (docker.errors.DockerException, engine.EngineError, OSError):
        return []
    return fleet.stored_log_lines(raw.decode("utf-8", "replace"))  # newlines only
