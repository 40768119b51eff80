"""The system disk where a host's engine cannot enforce it (issue 37): measured and acted on.

Every workspace and replica has a system disk (its own root filesystem: the files outside
its volumes, Cluster.root_disk_gb). On a host whose storage driver sizes root filesystems
(Host.root_disk_enforced, found by the host check) the engine refuses writes past it and
nothing here runs. On the others the monitor looks, every SUANLI_ROOT_DISK_CHECK_S, at
each of our running containers' writable layer (the engine's SizeRw: one container list
with sizes per host, which makes the engine walk every layer, hence the modest interval)
and acts:

- at 90 % a line on the cluster's timeline, once per node's workspace or replica attempt;
- at the limit writes stop: a workspace is paused (its processes and files kept, nothing
  written; the reconciler leaves it paused, where a stopped one it would start again),
  a job's replica is stopped (a paused job would be charged for doing nothing; the job
  ends as its retries say). The timeline says which, why, and what the researcher can do.

What this bounds is honest about itself: a container may write for up to one interval
past its limit before it is seen (at most the host's write speed times the interval),
and files are counted at their apparent size (a sparse file counts in full). Hosts that
must never exceed it run a driver that enforces it (docs/operator/storage.md, "The system disk").

Reads: clusters, hosts. Writes: the clusters' and jobs' timelines. Talks to: the engines.
"""

from __future__ import annotations

import logging
from datetime import datetime

import docker
from django.conf import settings
from django.core.cache import cache
from django.db import close_old_connections, transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Text
from jobs.events.timeline import cluster_event, job_event
from jobs.models import Cluster, ClusterEvent, Host, Job
from jobs.nodes import engine, runtime, workspaces

log = logging.getLogger("suanli.monitor")

WARN_SHARE = 0.9
GiB = 2**30
KIND_NEAR = "system-disk"
KIND_FULL = "system-disk-full"
GRACE_SLACK = 64 * 2**20  # what a workspace may write while its owner cleans up


def check_hosts(host_ids: set[int]) -> dict[str, str]:
    """One look at each of these hosts that does not enforce the system disk. Returns
    container name -> what was done ("warned", "paused", "stopped") for this round."""
    close_old_connections()
    done: dict[str, str] = {}
    for host in Host.objects.filter(pk__in=host_ids, root_disk_enforced=False):
        try:
            done.update(check_host(host))
        except (engine.EngineError, docker.errors.DockerException, OSError) as exc:
            log.warning("system disks on %s not measured: %s", host.name, exc)
    return done


def check_hosts_logged(host_ids: set[int]) -> dict[str, str]:
    """`check_hosts` for the monitor's thread: whatever goes wrong is logged, never lost."""
    try:
        return check_hosts(host_ids)
    except Exception:
        log.exception("system disk round")
        return {}


def check_host(host: Host) -> dict[str, str]:
    """Measure the running workspaces and replicas of one host against their system disk."""
    client = engine.client_for(host, timeout=max(settings.SUANLI_ENGINE_TIMEOUT, 120))
    try:
        rows = client.api.containers(size=True, filters={"label": runtime.LABEL_CLUSTER})
        done = {}
        for row in rows:
            labels = row.get("Labels") or {}
            if row.get("State") != "running" or workspaces.LABEL_SFTP in labels:
                continue  # paused already, or a read-only sftp session's
            action = _judge(client, row, labels)
            if action:
                done[(row.get("Names") or ["?"])[0].lstrip("/")] = action
        return done
    finally:
        client.close()


def _judge(client, row: dict, labels: dict) -> str:
    try:
        cluster_id = int(labels[runtime.LABEL_CLUSTER])
    except (KeyError, ValueError):
        return ""
    cluster = Cluster.objects.select_related("gpu_model", "instance_type").filter(pk=cluster_id)
    cluster = cluster.first()
    if cluster is None:
        return ""
    limit_gb = cluster.root_disk_gb
    used = int(row.get("SizeRw") or 0)
    if used < WARN_SHARE * limit_gb * GiB:
        return ""
    what = _what(labels)
    if used < limit_gb * GiB:
        cache.delete(_paused_key(row["Id"]))
        return _warn(cluster, what, used, limit_gb)
    return _stop_writes(client, row["Id"], cluster, labels, what, limit_gb, used)


def _paused_key(container_id: str) -> str:
    return f"suanli:rootdisk:paused:{container_id}"


def _what(labels: dict) -> Text:
    """The container in a researcher's words (also the key of its warning, once)."""
    if workspaces.LABEL in labels:
        return Text(gettext_noop("node %(node)s's workspace"), node=labels[workspaces.LABEL])
    return Text(
        gettext_noop("job %(job)s's replica %(rank)s (attempt %(attempt)s)"),
        job=labels.get(runtime.LABEL_JOB, "?"),
        rank=labels.get(runtime.LABEL_REPLICA, "?"),
        attempt=labels.get(runtime.LABEL_ATTEMPT, "?"),
    )


def _warn(cluster: Cluster, what: Text, used: int, limit_gb: int) -> str:
    with transaction.atomic():
        Cluster.objects.select_for_update().get(pk=cluster.pk)  # one warning, even if raced
        said = ClusterEvent.objects.filter(
            cluster=cluster, kind=KIND_NEAR, message__startswith=f"the system disk of {what} "
        )
        if said.exists():
            return ""
        cluster_event(
            cluster,
            KIND_NEAR,
            Text(
                gettext_noop(
                    "the system disk of %(what)s holds %(used)s GB of its %(limit)s GB (files "
                    "outside your volumes): free space or move files to a volume; at %(limit)s "
                    "GB its writes are stopped"
                ),
                what=what,
                used=f"{used / GiB:.1f}",
                limit=limit_gb,
            ),
        )
    return "warned"


def grace_s() -> int:
    """How long a workspace just started may stay over its system disk: the owner's time
    to free space after the stop and start the pause message asks for (two rounds at
    least, so the round right after the start never pauses it again)."""
    return max(300, 2 * settings.SUANLI_ROOT_DISK_CHECK_S)


def _just_started(client, container_id: str) -> bool:
    started = (client.api.inspect_container(container_id).get("State") or {}).get("StartedAt")
    try:
        since = timezone.now() - datetime.fromisoformat(str(started).replace("Z", "+00:00"))
    except ValueError:
        return False
    return since.total_seconds() < grace_s()


def _stop_writes(
    client, container_id: str, cluster: Cluster, labels: dict, what, limit_gb, used: int
) -> str:
    if workspaces.LABEL in labels:
        key = _paused_key(container_id)
        at_pause = cache.get(key)
        if (
            at_pause is not None
            and used <= at_pause + GRACE_SLACK
            and (_just_started(client, container_id))
        ):
            return ""  # the owner is freeing space after a stop and start, not writing more
        client.api.pause(container_id)
        # The size it was first paused at: a stop and start buys time to clean up, never
        # room to write more (kept in the monitor process; a restart only means no grace).
        cache.set(key, min(used, at_pause if at_pause is not None else used), 30 * 86400)
        message = Text(
            gettext_noop(
                "the system disk of %(what)s reached its %(limit)s GB limit: it is paused, its "
                "files kept. Stop and start the cluster, then free space or move files to a "
                "volume within %(minutes)s minutes, or release it"
            ),
            what=what,
            limit=limit_gb,
            minutes=grace_s() // 60,
        )
        action = "paused"
    else:
        client.api.stop(container_id, timeout=settings.SUANLI_STOP_GRACE_S)
        message = Text(
            gettext_noop(
                "the system disk of %(what)s reached its %(limit)s GB limit: it was stopped. "
                "Write large files to a volume"
            ),
            what=what,
            limit=limit_gb,
        )
        action = "stopped"
    with transaction.atomic():
        cluster_event(cluster, KIND_FULL, message)
        job = Job.objects.filter(pk=labels.get(runtime.LABEL_JOB) or None).first()
        if job is not None:
            job_event(job, KIND_FULL, message)
    log.warning("cluster %s: %s", cluster.pk, message)
    return action
