"""Stopping a job's containers: SIGTERM now, SIGKILL after the grace period (a delayed
task of this attempt only), and the signals themselves.

Layer: runs, over shared; uses shared, nodes (engine) and models.
"""

from __future__ import annotations

import logging

import docker
from django.conf import settings
from django.utils import timezone

from jobs.models import Job, Replica
from jobs.nodes import engine
from jobs.runs.shared import enqueue

log = logging.getLogger(__name__)


def stop(job_id: int) -> None:
    """SIGTERM every live replica now; SIGKILL whatever still runs after the grace period
    (a preempted job's is `SUANLI_PREEMPT_GRACE_S`)."""
    Job.objects.filter(pk=job_id, stop_requested_at__isnull=True).update(
        stop_requested_at=timezone.now()
    )
    for replica in Replica.objects.filter(
        job_id=job_id, state=Replica.State.RUNNING
    ).select_related("host"):
        send_signal(replica, "SIGTERM")
    job = (
        Job.objects.filter(pk=job_id)
        .values("attempt", "preempt_requested_at", "cancel_requested")
        .first()
    )
    if job is None:
        return
    # For this attempt only: a restart (after a preemption or a retry) inside the grace
    # period must not be killed by its predecessor's SIGKILL.
    enqueue(
        "jobs.tasks.job_kill", job_id, job["attempt"], job_id=f"kill-{job_id}",
        delay=grace(job["preempt_requested_at"] is not None and not job["cancel_requested"]),
    )  # fmt: skip


def grace(preempting: bool) -> int:
    return settings.SUANLI_PREEMPT_GRACE_S if preempting else settings.SUANLI_STOP_GRACE_S


def kill(job_id: int, attempt: int | None = None) -> None:
    replicas = Replica.objects.filter(job_id=job_id, state=Replica.State.RUNNING)
    if attempt is not None:
        replicas = replicas.filter(attempt=attempt)
    for replica in replicas.select_related("host"):
        send_signal(replica, "SIGKILL")


def send_signal(replica: Replica, signal: str) -> None:
    try:
        engine.cached_client(replica.host).containers.get(replica.container_name).kill(
            signal=signal
        )
    except docker.errors.NotFound:
        pass  # already gone: the reconciler records it
    except (docker.errors.APIError, engine.EngineError, OSError) as exc:
        # 409: not running any more; its exit is on its way to the watcher.
        log.info("signal %s to %s: %s", signal, replica.container_name, engine.describe(exc))
