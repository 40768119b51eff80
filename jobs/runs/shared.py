"""What every step of a run queues: a follow-up task of `jobs.tasks`, by name. (A job's
timeline entries are written by `jobs.events.timeline.job_event`.)

Layer: runs, the bottom of it; uses base (queue) only.
"""

from __future__ import annotations

from jobs.base.queue import enqueue_later, enqueue_unique


def enqueue(
    task: str, *args, job_id: str, delay: int | None = None, again_if_running: bool = False
):
    """A task of `jobs.tasks`, by name: deduplicated by `job_id`, or after `delay` seconds."""
    if delay:
        return enqueue_later(task, *args, delay_s=delay)
    return enqueue_unique("docker", task, *args, job_id=job_id, again_if_running=again_if_running)
