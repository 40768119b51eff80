"""Scheduled and idle shutdown (定时关机): a researcher's rules for stopping a cluster on its
own, set at creation (jobs/clusters/spec.py checks them) or later (`shutdown_set`), and
the cron tick that applies them.

* `stop_at`: stopped once at that moment (files kept: `services.cluster_stop`). The time
  is cleared as the tick applies it, and a stale one is cleared without a stop: the
  cluster was not running at that moment (stopped, waiting, or started again after it).
* `stop_idle_minutes` + `stop_idle_below`: stopped after N minutes in which every GPU of
  every node stayed under X % utilisation, by the monitor's samples. The samples come
  through `idle` (monitoring sits above jobs and reads its own tables:
  monitoring/idle.py): a window without samples for a node (the monitor down, a node
  just placed) is never idle, so an outage of the monitor stops nothing. A cluster must
  have run for the whole window, and one running without GPUs (no-GPU mode) is left
  alone.

Either rule stops within its owner's most stopped clusters (SUANLI_MAX_STOPPED_CLUSTERS, as
her own stop does): at that limit the cluster keeps running, its timeline says why, and the
rule is cleared (said once, not every minute).

Each stop writes its reason on the timeline through cluster_stop ("stopped at 23:00 CST as
scheduled"), which is also the `cluster.stopped` event; nothing else is emitted here.

Layer: clusters, beside services (its verbs) and spec (Schedule); uses events (timeline),
models and base.
"""

import logging
from datetime import datetime, timedelta
from typing import Protocol

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Moment, Text
from jobs.clusters import services
from jobs.clusters.spec import SHUTDOWN_FIELDS, Schedule
from jobs.events.timeline import cluster_event
from jobs.models import Cluster, Node

log = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)


class IdleReader(Protocol):
    """Whether every GPU of the cluster's nodes (by index) stayed under `below` percent
    in every minute of [start, end), with samples covering each minute of each node."""

    def __call__(
        self, cluster: Cluster, nodes: list[int], start: datetime, end: datetime, below: int
    ) -> bool: ...


@transaction.atomic
def shutdown_set(*, cluster: Cluster, schedule: Schedule) -> Cluster:
    """The cluster's rules replaced by a checked `schedule` (ShutdownRequest.validate)."""
    values = {name: getattr(schedule, name) for name in SHUTDOWN_FIELDS}
    Cluster.objects.filter(pk=cluster.pk).update(**values)
    for name, value in values.items():
        setattr(cluster, name, value)
    return cluster


def tick(*, idle: IdleReader, now: datetime | None = None) -> dict[str, list[int]]:
    """Cron: both rules, the scheduled stops first."""
    now = now or timezone.now()
    return {"scheduled": stop_scheduled(now=now), "idle": stop_idle(idle=idle, now=now)}


def stop_scheduled(*, now: datetime | None = None) -> list[int]:
    """Clusters whose `stop_at` has come are stopped, if they ran at that moment; the
    time is cleared either way (applied once)."""
    now = now or timezone.now()
    stopped = []
    due = Cluster.objects.filter(stop_at__isnull=False, stop_at__lte=now)
    for cluster_id in list(due.values_list("pk", flat=True)):
        with transaction.atomic():
            cluster = Cluster.objects.select_for_update(of=("self",)).filter(pk=cluster_id).first()
            if cluster is None or cluster.stop_at is None or cluster.stop_at > now:
                continue
            at = cluster.stop_at
            Cluster.objects.filter(pk=cluster.pk).update(stop_at=None)
            ran_then = (
                cluster.state == Cluster.State.RUNNING
                and cluster.running_since is not None
                and cluster.running_since <= at
            )
            if not ran_then:
                continue  # stale: not running then, or started again since
            reason = Text(gettext_noop("stopped at %(at)s as scheduled"), at=Moment(at, "%H:%M"))
            if _stop(cluster, reason):
                stopped.append(cluster.pk)
    return stopped


def stop_idle(*, idle: IdleReader, now: datetime | None = None) -> list[int]:
    """Running clusters whose GPUs all stayed under their threshold for their minutes,
    by the samples of the whole minutes before this one."""
    now = now or timezone.now()
    end = now.replace(second=0, microsecond=0)
    stopped = []
    candidates = Cluster.objects.filter(
        state=Cluster.State.RUNNING,
        no_gpu=False,
        gpus_per_node__gt=0,
        stop_idle_minutes__isnull=False,
        stop_idle_below__isnull=False,
    ).only("pk", "running_since", "stop_idle_minutes", "stop_idle_below")
    for candidate in list(candidates):
        minutes, below = candidate.stop_idle_minutes, candidate.stop_idle_below
        start = end - minutes * MINUTE
        if candidate.running_since is None or candidate.running_since > start:
            continue  # not running for the whole window yet
        nodes = sorted(
            Node.objects.filter(cluster_id=candidate.pk, released_at__isnull=True).values_list(
                "index", flat=True
            )
        )
        if not nodes or not idle(candidate, nodes, start, end, below):
            continue
        with transaction.atomic():
            cluster = (
                Cluster.objects.select_for_update(of=("self",)).filter(pk=candidate.pk).first()
            )
            if (
                cluster is None
                or cluster.state != Cluster.State.RUNNING
                or cluster.no_gpu
                or (cluster.stop_idle_minutes, cluster.stop_idle_below) != (minutes, below)
                or cluster.running_since is None
                or cluster.running_since > start
            ):
                continue  # changed meanwhile: the next tick judges it again
            reason = Text(
                gettext_noop(
                    "stopped after %(minutes)s minutes under %(below)s %% GPU utilisation"
                ),
                minutes=minutes,
                below=below,
            )
            if _stop(cluster, reason):
                stopped.append(cluster.pk)
            else:  # said once on its timeline, not every minute
                Cluster.objects.filter(pk=cluster.pk).update(
                    stop_idle_minutes=None, stop_idle_below=None
                )
    return stopped


def _stop(cluster: Cluster, reason: Text) -> bool:
    """Stop it within its owner's most stopped clusters (SUANLI_MAX_STOPPED_CLUSTERS, as her
    own stop: a rule is no way past the limit that keeps the hosts' disks; releasing it
    instead would lose its files). A stop refused (at the limit, or its workspaces gone
    meanwhile) leaves it running and is said on its timeline, once: the callers clear the
    rule."""
    try:
        with transaction.atomic():
            services.cluster_stop(cluster=cluster, reason=reason)
    except ValidationError as exc:
        log.warning("cluster %s: shutdown rule not applied: %s", cluster.pk, exc.messages[0])
        if exc.code == services.TOO_MANY_STOPPED:
            why = Text(
                gettext_noop(
                    "not stopped as its shutdown rule asked: you already keep %(kept)s stopped "
                    "clusters, the most allowed; release one, then stop this one yourself "
                    "(the rule is cleared)"
                ),
                kept=exc.params["kept"],
            )
        else:
            why = Text(
                gettext_noop("not stopped as its shutdown rule asked: %(why)s"),
                why=exc.messages[0],
            )
        cluster_event(cluster, "shutdown", why)
        return False
    return True
