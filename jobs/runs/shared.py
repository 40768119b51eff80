"""What every step of a run writes: a job's timeline event (with its webhook event) and a
follow-up task of `jobs.tasks`, queued by name."""

from __future__ import annotations

from jobs.base.queue import enqueue_later, enqueue_unique
from jobs.base.text import Text, json_of
from jobs.events import webhooks
from jobs.models import JobEvent


def event(job_id: int, kind: str, message: str | Text = "") -> None:
    """The job's timeline, and its webhook event, in the caller's transaction."""
    JobEvent.objects.create(
        job_id=job_id, kind=kind, message=str(message)[:500], text=json_of(message)
    )
    webhooks.job_changed(job_id, kind)


def enqueue(
    task: str, *args, job_id: str, delay: int | None = None, again_if_running: bool = False
):
    """A task of `jobs.tasks`, by name: deduplicated by `job_id`, or after `delay` seconds."""
    if delay:
        return enqueue_later(task, *args, delay_s=delay)
    return enqueue_unique("docker", task, *args, job_id=job_id, again_if_running=again_if_running)
