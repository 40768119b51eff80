"""Queueing work of a higher part from a lower one: by the task's dotted name, which RQ
imports when the task runs, never by importing it here (DESIGN.md, "Apps and their
layers"). Sent once the caller's transaction commits."""

from __future__ import annotations

import logging

import django_rq
from django.db import transaction

log = logging.getLogger(__name__)


def enqueue_by_name(func: str, *args, job_id: str, queue: str = "docker") -> None:
    def send() -> None:
        try:
            django_rq.get_queue(queue).enqueue(func, *args, job_id=job_id)
        except Exception as exc:  # Redis down: the reconciler and the job start catch up
            log.warning("could not queue %s%s: %s", func, args, exc)

    transaction.on_commit(send)
