"""A task asked for many times at once (`enqueue_many_unique`, the pools' cron round) is
queued as one asked for on its own (`enqueue_unique`) would be: once while one waits, its
one follow-up while one runs, again once the last is over."""

import django_rq
import pytest
from rq.job import JobStatus

from jobs.base.queue import enqueue_many_unique, enqueue_unique

pytestmark = pytest.mark.django_db

TASK = "jobs.tasks.cluster_dispatch"
S = JobStatus
STATES = [None, S.QUEUED, S.STARTED, S.DEFERRED, S.SCHEDULED, S.FINISHED, S.FAILED]
# The job's state and its follow-up's: every pair that can be seen
CASES = [(first, follow) for first in STATES for follow in STATES]


def _set_up(queue, job_id: str, first, follow) -> None:
    for candidate, status in ((job_id, first), (f"{job_id}-next", follow)):
        if status is not None:
            queue.enqueue(TASK, 0, job_id=candidate).set_status(status)


def _seen(queue, job_id: str) -> list:
    found = [queue.fetch_job(c) for c in (job_id, f"{job_id}-next")]
    return [job.get_status(refresh=True) if job is not None else None for job in found]


@pytest.mark.parametrize("again", [False, True])
def test_many_at_once_queue_what_one_each_would(again):
    queue = django_rq.get_queue("docker", commit_mode="auto")
    for n, (first, follow) in enumerate(CASES):
        _set_up(queue, f"one-{n}", first, follow)
        _set_up(queue, f"many-{n}", first, follow)
    for n in range(len(CASES)):
        enqueue_unique("docker", TASK, n, job_id=f"one-{n}", again_if_running=again, at_once=True)
    enqueue_many_unique(
        "docker", TASK, [((n,), f"many-{n}") for n in range(len(CASES))], again_if_running=again
    )
    for n, case in enumerate(CASES):
        assert _seen(queue, f"many-{n}") == _seen(queue, f"one-{n}"), case
    after = {case: _seen(queue, f"one-{n}") for n, case in enumerate(CASES)}
    assert after[None, None] == after[S.FINISHED, None] == [S.QUEUED, None]
    assert after[S.QUEUED, None] == [S.QUEUED, None]  # still once
    assert after[S.STARTED, None] == [S.STARTED, S.QUEUED if again else None]
    assert after[S.STARTED, S.STARTED] == [S.STARTED, S.STARTED]
