"""Settling an attempt's outcome: from its replicas' ends (level-triggered, so any caller
may ask again), the job succeeds, fails, is retried, waits again after a host failed it
or after a preemption, or is cancelled; `finish` ends it and frees or releases its
cluster.

Layer: runs, over stopping; uses stopping, events (lifecycle, outbox, timeline), models and
base (text).
"""

from __future__ import annotations

from django.db import models, transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Moment, Text, argument, join, stored_reason
from jobs.events import lifecycle
from jobs.events.outbox import enqueue_after_commit
from jobs.events.timeline import job_event, reason_fields
from jobs.models import Cluster, Job, JobProgress, Replica
from jobs.runs.stopping import stop

# Attempts ended by hosts before a job is failed after all: a job that breaks every host it
# lands on (or a host classed wrongly) must not run for ever.
MAX_HOST_RESTARTS = 10


PROFILES_TASK = "monitoring.tasks.profiles_summarise"  # a higher app's task, queued by name
ENERGY_TASK = "monitoring.tasks.job_energy"  # its GPU energy kept on the job, by name too


POOL_TASK = "jobs.tasks.pool_scale"  # jobs/pools/autoscaler.py, above the runner


SWEEP_TASK = "jobs.tasks.sweep_job_ended"  # jobs/pools/sweeps.py
PROGRESS_TASK = "jobs.tasks.job_progress_ended"  # jobs/runs/progress.py: its last lines


def settle(job_id: int) -> None:
    """Decide the job's next state from its replicas (level-triggered)."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).select_related("cluster").get(pk=job_id)
        if job.is_ended or job.state in Job.WAITING:
            return
        replicas = list(
            Replica.objects.filter(job=job, attempt=job.attempt)
            .select_related("host")
            .order_by("finished_at", "rank")
        )
        done = [r for r in replicas if r.state in (Replica.State.EXITED, Replica.State.LOST)]
        failed = [r for r in done if r.state == Replica.State.LOST or r.exit_code != 0]
        all_done = len(done) == len(replicas)
    if job.cancel_requested:
        if all_done:
            _settle_cancelled(job, replicas, done)
    elif job.preempt_requested_at is not None:
        if all_done:
            _settle_preempted(job, done, failed)
    elif failed:
        _settle_failed(job, done, failed, all_done)
    elif all_done:
        finish(
            job.pk,
            Job.State.SUCCEEDED,
            Text(gettext_noop("all replicas exited with code 0")),
            exit_code=0,
            at=_last_end(done),
        )


def _settle_cancelled(job: Job, replicas: list[Replica], done: list[Replica]) -> None:
    """A cancelled job whose replicas have all ended. Its exit code is its replicas' when
    they all exited (the first non-zero one, else 0); none when a replica was lost or never
    ran."""
    codes = [r.exit_code for r in done if r.state == Replica.State.EXITED]
    code = None
    if replicas and len(codes) == len(replicas) and None not in codes:
        code = next((c for c in codes if c != 0), 0)
    finish(job.pk, Job.State.CANCELLED, cancelled(job), exit_code=code)


def _settle_preempted(job: Job, done: list[Replica], failed: list[Replica]) -> None:
    """A preempted attempt whose replicas have all ended. Exit codes of a preempted attempt
    are the signal's, not the job's failure; but a job whose replicas all ended with 0
    before the SIGTERM had simply finished."""
    notice = job.preempt_requested_at
    if not failed and all(r.finished_at and r.finished_at < notice for r in done):
        finish(
            job.pk,
            Job.State.SUCCEEDED,
            Text(gettext_noop("all replicas exited with code 0 (before the preemption notice)")),
            exit_code=0,
        )
    else:
        preempted(job)  # whatever ended after the notice runs again from its checkpoint


def _settle_failed(job: Job, done: list[Replica], failed: list[Replica], all_done: bool) -> None:
    """A replica failed: the others are stopped; once all have ended the job runs again
    (a host's failure, or a retry left) or fails with the first failure's cause."""
    first = failed[0]
    lost_to_host = [r for r in failed if r.host_fault]
    if lost_to_host:
        # The host's failure, not the job's: stop the rest, then run it again.
        cause = Text(
            gettext_noop("%(ranks)s lost to %(hosts)s"),
            ranks=join([Text(gettext_noop("rank %(rank)s"), rank=r.rank) for r in lost_to_host]),
            hosts=", ".join(sorted({r.host.name for r in lost_to_host})),
        )
        if not all_done:
            _stop_the_rest(job, cause)
            return
        _requeue_after_host(job, cause)
        return
    if job.state_reason.startswith("could not start"):
        cause = stored_reason(job)  # the engine's own words, e.g. a failed pull
    elif first.state == Replica.State.LOST:
        cause = Text(gettext_noop("rank %(rank)s was lost"), rank=first.rank)
    else:
        cause = Text(
            gettext_noop("rank %(rank)s exited with code %(code)s"),
            rank=first.rank,
            code=first.exit_code,
        )
    if not all_done:
        _stop_the_rest(job, cause)
        return
    used = job.attempt - job.preemptions - job.host_restarts  # failed attempts so far
    if used <= job.retries:
        _requeue(
            job,
            Text(
                gettext_noop("%(cause)s; retry %(used)s of %(retries)s"),
                cause=cause,
                used=used,
                retries=job.retries,
            ),
        )
        return
    finish(
        job.pk,
        Job.State.FAILED,
        cause.removesuffix("; stopping the other replicas") if isinstance(cause, str) else cause,
        exit_code=first.exit_code,
        at=_last_end(done),
    )


def _last_end(replicas: list[Replica]):
    return max((r.finished_at for r in replicas if r.finished_at), default=None)


def _stop_the_rest(job: Job, cause: str | Text) -> None:
    """One replica ended the attempt: stop the others, once (a second settle finds the
    reason already said)."""
    reason = Text(gettext_noop("%(cause)s; stopping the other replicas"), cause=cause)
    said = reason_fields(Job, reason)
    if Job.objects.filter(pk=job.pk).exclude(state_reason=said["state_reason"]).update(**said):
        job_event(job.pk, "stopping", reason)
        stop(job.pk)


def _requeue_after_host(job: Job, cause: str | Text) -> None:
    """Every replica of an attempt that a host ended has stopped: the job waits again, at
    the head of its cluster's queue, and starts from its newest checkpoint once the
    cluster has its capacity back (the host answers again, or its nodes moved)."""
    if job.host_restarts >= MAX_HOST_RESTARTS:
        finish(
            job.pk,
            Job.State.FAILED,
            Text(
                gettext_noop(
                    "%(cause)s; its hosts failed it %(times)s times, the most a job is run "
                    "again for (tell the operator)"
                ),
                cause=cause,
                times=job.host_restarts + 1,
            ),
            exit_code=None,
        )
        return
    reason = (
        stored_reason(job)  # the start's own sentence ("the host ... could not start")
        if job.state_reason.startswith("the host ")
        else Text(
            gettext_noop(
                "%(cause)s; runs again from its last checkpoint once its cluster has its "
                "capacity back (no retry used)"
            ),
            cause=cause,
        )
    )
    with transaction.atomic():
        if Job.objects.filter(pk=job.pk, state__in=Job.ACTIVE).update(
            state=Job.State.QUEUED,
            **reason_fields(Job, reason),
            host_restarts=models.F("host_restarts") + 1,
        ):
            job_event(job.pk, "requeued", reason)
            lifecycle.request_dispatch(job.cluster_id)
            lifecycle.request_placement()  # the pass that moves its nodes off a failed host
    lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)  # no-op unless preempting


def _requeue(job: Job, reason: str | Text) -> None:
    with transaction.atomic():
        if Job.objects.filter(pk=job.pk, state__in=Job.ACTIVE).update(
            state=Job.State.QUEUED, **reason_fields(Job, reason)
        ):
            job_event(job.pk, "retrying", reason)
            lifecycle.request_dispatch(job.cluster_id)
    lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)  # no-op unless preempting


def preempted(job: Job) -> None:
    """Every replica of a preempted attempt has ended: count it, and put the job back to
    wait for its cluster (or fail it past its preemption limit)."""
    with transaction.atomic():
        Cluster.objects.select_for_update().filter(pk=job.cluster_id).first()
        job = Job.objects.select_for_update(of=("self",)).get(pk=job.pk)
        if job.state not in Job.ACTIVE or job.preempt_requested_at is None:
            return
        if job.cancel_requested:  # cancelled while the notice ran: it ends here
            finish(job.pk, Job.State.CANCELLED, cancelled(job), exit_code=None)
            lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)
            return
        count = job.preemptions + 1
        said = stored_reason(job)
        reason = argument(said, lifecycle.NOTICE)
        if reason is None:  # another reason, or plain words (a row from before their twin)
            reason = said if isinstance(said, Text) else said.removeprefix("preemption notice: ")
        reason = reason or Text(gettext_noop("preempted"))
        if count > job.max_preemptions:
            Job.objects.filter(pk=job.pk).update(preemptions=count)
            finish(
                job.pk,
                Job.State.FAILED,
                Text(
                    gettext_noop(
                        "preempted %(count)s times, more than its limit of %(limit)s "
                        "(last: %(reason)s)"
                    ),
                    count=count,
                    limit=job.max_preemptions,
                    reason=reason,
                ),
                exit_code=None,
            )
        else:
            at = Moment(job.preempt_requested_at, "%Y-%m-%d %H:%M:%S")
            Job.objects.filter(pk=job.pk).update(
                state=Job.State.PREEMPTED,
                preemptions=count,
                **reason_fields(
                    Job,
                    Text(
                        gettext_noop(
                            "preempted at %(at)s: %(reason)s; resumes when its cluster is placed "
                            "again"
                        ),
                        at=at,
                        reason=reason,
                    ),
                ),
            )
            job_event(
                job.pk,
                "preempted",
                Text(
                    gettext_noop("preemption %(count)s of at most %(limit)s: %(reason)s"),
                    count=count,
                    limit=job.max_preemptions,
                    reason=reason,
                ),
            )
        lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)


def cancelled(job: Job) -> Text | str:
    """Why a cancelled job ended: its reason ("cancelled by ..."), else "cancelled"."""
    return stored_reason(job) or Text(gettext_noop("cancelled"))


def finish(job_id: int, state: str, reason: str | Text, *, exit_code: int | None, at=None) -> None:
    """End the job: `at` is when it really ended (its last container's end) when known."""
    now = timezone.now()
    ended = min(at, now) if at is not None else now
    with transaction.atomic():
        # Lock order everywhere: cluster, then job (cluster_release, job_submit, dispatch).
        cluster_id = Job.objects.values_list("cluster_id", flat=True).get(pk=job_id)
        Cluster.objects.select_for_update().filter(pk=cluster_id).first()
        job = Job.objects.select_related("cluster").get(pk=job_id)
        if (
            not Job.objects.filter(pk=job_id)
            .exclude(state__in=Job.ENDED)
            .update(
                state=state, exit_code=exit_code, finished_at=ended, **reason_fields(Job, reason)
            )
        ):
            return
        job_event(job_id, state, reason)
        if job.pool_id:
            # The pool may shrink now; a sweep's trial makes room for the next (by name:
            # both are above the runner).
            enqueue_after_commit(
                "default", POOL_TASK, job.pool_id, job_id=f"pool-scale-{job.pool_id}",
                again_if_running=True,
            )  # fmt: skip
            enqueue_after_commit(
                "default", SWEEP_TASK, job_id, job_id=f"sweep-job-{job_id}",
                again_if_running=True,
            )  # fmt: skip
        if JobProgress.objects.filter(job_id=job_id).exists():
            # Its progress's last lines (then its projection's last word, by name above us).
            enqueue_after_commit(
                "default", PROGRESS_TASK, job_id, job_id=f"progress-end-{job_id}",
                again_if_running=True,
            )  # fmt: skip
        # Its profiler traces, if it wrote any, are summarised once it has ended (queued
        # after the commit, kept until Redis took it: the outbox).
        enqueue_after_commit(
            "profiles", PROFILES_TASK, job_id, job_id=f"profiles-{job_id}", again_if_running=True
        )
        enqueue_after_commit(
            "default", ENERGY_TASK, job_id, job_id=f"energy-{job_id}", again_if_running=True
        )
        cluster = job.cluster
        Cluster.objects.filter(pk=cluster.pk).update(last_active_at=now)
        more = (
            cluster.jobs.filter(state__in=[*Job.WAITING, *Job.ACTIVE]).exclude(pk=job_id).exists()
        )
        if (
            not more
            and cluster.release_policy == Cluster.ReleasePolicy.AFTER_LAST_JOB
            and cluster.state in (Cluster.State.RUNNING, Cluster.State.PREEMPTING)
        ):
            lifecycle.cluster_release(
                cluster=cluster,
                reason=Text(
                    gettext_noop("released automatically after job %(job)s finished"),
                    job=job.name,
                ),
            )
        elif cluster.state == Cluster.State.PREEMPTING:
            lifecycle.cluster_requeue_preempted(cluster_id=cluster.pk)
        else:
            lifecycle.request_dispatch(cluster.pk)
