"""A preemption notice followed: the job's preemption script run in every running replica,
then the replicas stopped once the scripts end or their time is up (`settle` then puts
the job back to wait for its cluster).

Layer: runs, over settle, stopping and shared; uses them, nodes (engine, runtime), events
(timeline), models and base (text).
"""

from __future__ import annotations

import docker
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Text
from jobs.events.timeline import job_event
from jobs.models import Job, Replica
from jobs.nodes import engine, runtime
from jobs.runs.settle import settle
from jobs.runs.shared import enqueue
from jobs.runs.stopping import stop


def _start_scripts(job: Job) -> None:
    """Idempotent: a replica whose script was started keeps its exec id and is not given a
    second one (a replica that started after the notice gets its script on the next look)."""
    if not job.preemption_script.strip():
        return
    reason = job.cluster.state_reason.removeprefix("preempting: ") or "spot capacity reclaimed"
    if job.cancel_requested:  # a stop for good with its script first (a budget's): its reason
        reason = job.state_reason
    for replica in Replica.objects.filter(
        job=job, attempt=job.attempt, state=Replica.State.RUNNING, preempt_exec_id=""
    ).select_related("host"):
        try:
            api = engine.cached_client(replica.host).api
            exec_id = api.exec_create(
                replica.container_name, **runtime.preemption_exec(job, reason)
            )["Id"]
            api.exec_start(exec_id, detach=True)
        except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
            # Not running any more, or the engine is gone: nothing to save there.
            job_event(
                job.pk,
                "notice",
                Text(
                    gettext_noop("rank %(rank)s: preemption script not run: %(error)s"),
                    rank=replica.rank,
                    error=engine.describe(exc),
                ),
            )
            exec_id = "-"
        Replica.objects.filter(pk=replica.pk, preempt_exec_id="").update(preempt_exec_id=exec_id)


def preempt(job_id: int) -> None:
    """The notice and what follows it: run the job's preemption script in every running
    replica (`docker exec`, detached; also in replicas that started after the notice),
    then stop the replicas once every script has ended or its time limit is up; until
    then look again in a second. A script still running at the limit dies with its
    container (SIGTERM, then SIGKILL after the grace period)."""
    job = Job.objects.select_related("cluster").get(pk=job_id)
    if (
        job.preempt_requested_at is None
        or job.stop_requested_at is not None
        or job.state not in Job.ACTIVE
    ):
        return
    _start_scripts(job)
    limit = settings.SUANLI_PREEMPT_SCRIPT_S
    overdue = (timezone.now() - job.preempt_requested_at).total_seconds() >= limit
    results: list[Text] = []
    waiting = False
    for replica in Replica.objects.filter(
        job=job, attempt=job.attempt, state=Replica.State.RUNNING
    ).select_related("host"):
        if replica.preempt_exec_id in ("", "-"):
            continue  # no script (or it could not be run)
        try:
            state = engine.cached_client(replica.host).api.exec_inspect(replica.preempt_exec_id)
        except (docker.errors.DockerException, engine.EngineError, OSError):
            continue  # the container went: its exit is on its way
        if state.get("Running"):
            waiting = True
            results.append(
                Text(
                    gettext_noop(
                        "rank %(rank)s: preemption script still running after its %(limit)s s "
                        "limit; stopped with the replica"
                    ),
                    rank=replica.rank,
                    limit=limit,
                )
            )
        else:
            results.append(
                Text(
                    gettext_noop("rank %(rank)s: preemption script exited with code %(code)s"),
                    rank=replica.rank,
                    code=state.get("ExitCode"),
                )
            )
    if waiting and not overdue:
        enqueue("jobs.tasks.job_preempt", job_id, job_id=f"preempt-{job_id}", delay=1)
        return
    with transaction.atomic():
        # Compare-and-set: a duplicate (the reconciler's net) finds the stop already made.
        if not Job.objects.filter(pk=job_id, stop_requested_at__isnull=True).update(
            stop_requested_at=timezone.now()
        ):
            return
        for line in results:
            job_event(job_id, "notice", line)
        job_event(
            job_id,
            "stopping",
            Text(
                gettext_noop("preemption: SIGTERM now, SIGKILL after %(grace)s s"),
                grace=settings.SUANLI_PREEMPT_GRACE_S,
            ),
        )
    stop(job_id)
    settle(job_id)  # a job with no running replica left is preempted at once
