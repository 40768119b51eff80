"""Queueing work of a higher part from a lower one: by the task's dotted name
("jobs.tasks.cluster_dispatch"), which RQ imports when the task runs, never by importing
it here (docs/architecture.md, "Apps and their layers").

Layer: base, under every package that queues work; uses no other part (django_rq and rq only).
The one place that knows RQ's deduplication and delays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import django_rq
from django.db import transaction
from rq.job import Job, JobStatus

log = logging.getLogger(__name__)

_PENDING = {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED}

# What RQ runs: a task's dotted name (from below `tasks`), or the function (from `tasks`).
Task = str | Callable


def enqueue_unique(
    queue_name: str,
    func: Task,
    *args,
    job_id: str,
    again_if_running=False,
    at_once=False,
    **options,
):
    """Enqueue unless a job with this id is still waiting (RQ itself would overwrite it and
    queue it twice). With `again_if_running`, a job that is already running gets one
    follow-up queued behind it, for work that must see what changed after it started.
    Inside a transaction django_rq queues it once that commits, unless `at_once` (the
    outbox, jobs/events/outbox.py, sends under a row lock and must know Redis took it)."""
    queue = django_rq.get_queue(queue_name, commit_mode="auto" if at_once else None)
    found: dict[str, tuple[Job | None, JobStatus | None]] = {}

    def status_of(candidate: str) -> JobStatus | None:
        existing = queue.fetch_job(candidate)
        status = existing.get_status(refresh=True) if existing is not None else None
        found[candidate] = (existing, status)
        return status

    target = _unique_id(job_id, status_of, again_if_running=again_if_running)
    if target is not None:
        return queue.enqueue(func, *args, job_id=target, **options)
    # Not queued: the job that waits or runs (None where its follow-up runs too).
    candidate, (existing, status) = list(found.items())[-1]
    return None if candidate != job_id and status == JobStatus.STARTED else existing


def _unique_id(
    job_id: str, status_of: Callable[[str], JobStatus | None], *, again_if_running: bool
) -> str | None:
    """The id `enqueue_unique` queues its call under: `job_id`, or with `again_if_running`
    its follow-up `<job_id>-next` while that one runs; None: the job of that id still waits
    or runs (`status_of`: an id's RQ status, None where there is no such job)."""
    status = status_of(job_id)
    if status == JobStatus.STARTED and again_if_running:
        job_id = _follow_up(job_id)
        status = status_of(job_id)
    return None if status in _PENDING else job_id


def _follow_up(job_id: str) -> str:
    """The id of a job's one follow-up (`again_if_running`)."""
    return f"{job_id}-next"


def enqueue_later(func: Task, *args, delay_s: int, queue: str = "docker", **options):
    """Run the task once `delay_s` seconds have passed (RQ's scheduler; not deduplicated).
    RQ keeps the time in whole seconds, cut down: round up, so that e.g. a stop's grace
    period is never shortened (up to a second early was seen: a SIGKILL 2.6 s into 3)."""
    at = datetime.now(UTC) + timedelta(seconds=delay_s)
    if at.microsecond:
        at = at.replace(microsecond=0) + timedelta(seconds=1)
    return django_rq.get_queue(queue).enqueue_at(at, func, *args, **options)


def enqueue_by_name(func: str, *args, job_id: str, queue: str = "docker", **options) -> None:
    """Once the caller's transaction commits; a Redis that is down is logged, not raised."""

    def send() -> None:
        try:
            django_rq.get_queue(queue).enqueue(func, *args, job_id=job_id, **options)
        except Exception as exc:  # Redis down: the reconciler and the job start catch up
            log.warning("could not queue %s%s: %s", func, args, exc)

    transaction.on_commit(send)


def enqueue_many_by_name(
    func: str, calls: list[tuple[tuple, str]], *, queue: str = "docker"
) -> None:
    """`enqueue_by_name` for many calls of one task, each `(args, job_id)`: once the caller's
    transaction commits, in one Redis pipeline (one connection and one round trip, where
    one enqueue each would open a client and make several round trips: a placement pass's
    networks). A Redis that is down is logged, not raised."""
    if not calls:
        return

    def send() -> None:
        try:
            q = django_rq.get_queue(queue)
            q.enqueue_many([q.prepare_data(func, args, job_id=job_id) for args, job_id in calls])
        except Exception as exc:  # Redis down: the reconciler and the job start catch up
            log.warning("could not queue %s for %d call(s): %s", func, len(calls), exc)

    transaction.on_commit(send)


def enqueue_many_unique(
    queue_name: str, func: Task, calls: list[tuple[tuple, str]], *, again_if_running=False
) -> int:
    """`enqueue_unique` (with `at_once`) for many calls of one task, each `(args, job_id)`,
    on one connection: the state of every id read in one Redis round trip (its follow-up's
    in a second, for those running), the new jobs queued in one more (a cron round's
    dispatches: one enqueue_unique each opened a client and made three round trips).
    Returns how many were queued."""
    if not calls:
        return 0
    queue = django_rq.get_queue(queue_name, commit_mode="auto")
    known = {s.value: s for s in JobStatus}

    def states(ids: list[str]) -> dict[str, JobStatus | None]:
        with queue.connection.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(queue.job_class.key_for(job_id), "status", "origin")
            found = pipe.execute()
        # As fetch_job: a job of another queue is none of this one's.
        mine = queue.name.encode()
        return {
            job_id: known.get(status.decode()) if status and origin == mine else None
            for job_id, (status, origin) in zip(ids, found, strict=True)
        }

    # The ids' states, then (again_if_running) their follow-ups' where they run, each in
    # one round trip; `_unique_id` reads them as `enqueue_unique` reads one.
    known_states = states([job_id for _args, job_id in calls])
    if again_if_running:
        running = [job_id for job_id, s in known_states.items() if s == JobStatus.STARTED]
        known_states |= states([_follow_up(job_id) for job_id in running])
    new = []
    for args, job_id in calls:
        target = _unique_id(job_id, known_states.__getitem__, again_if_running=again_if_running)
        if target is not None:
            new.append(queue.prepare_data(func, args, job_id=target))
    if new:
        queue.enqueue_many(new)
    return len(new)
