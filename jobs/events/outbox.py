"""Work queued after a commit, never lost to a Redis that is away.

A change that asks for follow-up work (a job ended: its profile summary, the cluster's next
dispatch) writes an OutboxTask row in its own transaction; once the transaction commits the
row is sent to RQ and deleted. A send that fails (Redis is down, restarting, or the process
was killed between the commit and the send) leaves the row, and `flush` (cron, every
FLUSH_S seconds: console/cron.py) sends it once Redis answers. Durable rows rather than
an in-process retry: a process killed while Redis is down loses nothing either. A flush
takes only rows older than SETTLED_S (their own commit sent them by then, or failed to),
under their row locks (two flushes never both send one); rows of the same task (queue,
name, arguments, RQ id) are sent once together. At worst (a transaction that committed
more than SETTLED_S after it wrote the row, as a flush ran) a task is queued twice, which
enqueue_unique and the tasks themselves (level-triggered) make harmless.

    outbox.enqueue_after_commit("docker", "jobs.tasks.cluster_dispatch", cluster_id,
                                job_id=f"dispatch-{cluster_id}", again_if_running=True)

Layer: events (beside lifecycle, which asks its follow-up work through it); uses models and
base (queue).
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from jobs.base.queue import enqueue_unique
from jobs.models import OutboxTask

log = logging.getLogger(__name__)

FLUSH_S = 5  # cron sends what a commit could not, this often
BATCH = 500  # rows one flush takes at most
SETTLED_S = 10  # a row this old was sent by its commit, or Redis did not take it


def enqueue_after_commit(
    queue: str, func: str, *args, job_id: str, again_if_running: bool = False, **options
) -> None:
    """Queue `func` (a task's dotted name) with `args` (JSON values) once the caller's
    transaction commits (deduplicated by `job_id`: jobs.base.queue.enqueue_unique), kept
    until Redis took it."""
    row = OutboxTask.objects.create(
        queue=queue, func=func, args=list(args), job_id=job_id,
        again_if_running=again_if_running, options=options,
    )  # fmt: skip
    transaction.on_commit(lambda: _send_committed(row))


def _send(row: OutboxTask) -> None:
    enqueue_unique(
        row.queue, row.func, *row.args, job_id=row.job_id,
        again_if_running=row.again_if_running, at_once=True, **row.options,
    )  # fmt: skip


def _send_committed(row: OutboxTask) -> None:
    """Right after the commit: send the task and delete its row; left for `flush` when
    Redis does not take it (logged, never raised into the committed caller)."""
    try:
        _send(row)
        OutboxTask.objects.filter(pk=row.pk).delete()
    except Exception as exc:
        log.warning("could not queue %s (%s) now, sent once Redis answers: %s", row.func,
                    row.job_id, exc)  # fmt: skip


def flush() -> int:
    """Send what commits left behind (oldest first), each distinct task once; the rows
    of the tasks sent are deleted, the rest wait for the next flush. Returns how many
    tasks were sent."""
    sent = 0
    with transaction.atomic():
        settled = timezone.now() - timedelta(seconds=SETTLED_S)
        rows = list(
            OutboxTask.objects.select_for_update(skip_locked=True)
            .filter(created_at__lt=settled)
            .order_by("pk")[:BATCH]
        )
        if not rows:
            return 0
        groups: dict[tuple, list[OutboxTask]] = {}
        for row in rows:
            key = (row.queue, row.func, json.dumps(row.args), row.job_id)
            groups.setdefault(key, []).append(row)
        done: list[int] = []
        for group in groups.values():
            try:
                _send(group[-1])
            except Exception as exc:  # Redis away again: the rest waits for the next flush
                log.warning("could not queue %s (%s): %s", group[-1].func, group[-1].job_id, exc)
                break
            done += [row.pk for row in group]
            sent += 1
        OutboxTask.objects.filter(pk__in=done).delete()
    if sent:
        log.info("queued %s task(s) a commit could not", sent)
    return sent
