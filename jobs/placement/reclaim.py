"""Spot capacity reclaimed for on-demand requests: the first on-demand request of a
resource that does not fit (and has waited `SUANLI_RECLAIM_AFTER_S`) preempts running spot
clusters, youngest first, until it fits, then spares those it turns out not to need
(greedy, so not always the smallest set). Spot clusters placed less than
`SUANLI_SPOT_MIN_RUN_S` ago are spared.

Layer: placement, over capacity, under scheduler; uses capacity, events (lifecycle), models and
base (text).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import timedelta

from django.conf import settings
from django.db.models import Count
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Text
from jobs.events import lifecycle
from jobs.models import Cluster, Node
from jobs.placement.capacity import Fleet, HostCap, PassReport

log = logging.getLogger(__name__)


@dataclass
class SpotHolder:
    """A running spot cluster as a reclaim candidate: what each of its hosts gets back."""

    cluster_id: int
    since: object  # running_since: the youngest (latest) goes first
    gives: dict[int, tuple[int, int]]  # host id -> (GPUs, vCPUs) it holds there


class _WhatIf:
    """The request's usable hosts with capacity added or taken away one spot cluster at a
    time: a Fleet of its own, updated in place, so each "does it fit now?" costs one plan
    (a few bucket look-ups), not a rebuild."""

    def __init__(self, hosts: list[HostCap], soon: dict[int, tuple[int, int]]):
        self.fleet = Fleet([replace(h) for h in hosts])
        self.add(soon)

    def add(self, gives: dict[int, tuple[int, int]], sign: int = 1) -> None:
        for host_id, (gpus, vcpus) in gives.items():
            cap = self.fleet.hosts.get(host_id)
            if cap is None:
                continue  # a host the request cannot use
            if gpus:
                self.fleet.set_free(host_id, cap.free + sign * gpus)
            cap.cpu_free += sign * vcpus

    def fits(self, cluster: Cluster) -> bool:
        return self.fleet.plan(cluster) is not None


def choose_victims(
    cluster: Cluster, hosts: list[HostCap], soon: dict[int, tuple[int, int]], holders
) -> list[SpotHolder] | None:
    """The spot clusters to preempt so that `cluster` fits: youngest first, then every one
    whose capacity turns out not to be needed is dropped again (oldest first), so only
    what the request needs is taken. [] when the capacity already being reclaimed is
    enough; None when even all the spot capacity would not make it fit."""
    what_if = _WhatIf(hosts, soon)
    if what_if.fits(cluster):
        return []
    usable = {h.id for h in hosts}
    chosen: list[SpotHolder] = []
    for holder in sorted(holders, key=lambda h: (h.since, h.cluster_id), reverse=True):
        if not usable & holder.gives.keys():
            continue
        chosen.append(holder)
        what_if.add(holder.gives)
        if what_if.fits(cluster):
            break
    else:
        return None
    for holder in sorted(chosen, key=lambda h: (h.since, h.cluster_id)):
        what_if.add(holder.gives, -1)
        if what_if.fits(cluster):
            chosen.remove(holder)  # not needed after all
        else:
            what_if.add(holder.gives)
    return chosen


def _spot_capacity() -> tuple[list[SpotHolder], dict[int, tuple[int, int]]]:
    """Running spot clusters' nodes (the candidates) and what preempting clusters hold
    now and give back soon, per host. None running or preempting (most passes): one look-up
    in the queue's (state, queued_at) index, not the join of the live nodes with their slots
    (0.1-0.2 s a pass with thousands of live nodes)."""
    live = [Cluster.State.RUNNING, Cluster.State.PREEMPTING]
    if not Cluster.objects.filter(state__in=live, spot=True).exists():
        return [], {}
    holders: dict[int, SpotHolder] = {}
    soon_g: dict[int, int] = defaultdict(int)
    soon_c: dict[int, int] = defaultdict(int)
    rows = (
        Node.objects.filter(
            released_at__isnull=True,
            cluster__state__in=[Cluster.State.RUNNING, Cluster.State.PREEMPTING],
            cluster__spot=True,
        )
        .annotate(gpus=Count("slots"))
        .values_list(
            "cluster_id", "cluster__state", "cluster__running_since", "host_id", "gpus", "vcpus"
        )
    )
    # A spot cluster placed moments ago is not a candidate yet: it gets at least
    # SUANLI_SPOT_MIN_RUN_S of work per placement (no thrash, and no stream of throw-away
    # on-demand requests can keep another tenant's job from ever running).
    protected_since = timezone.now() - timedelta(seconds=settings.SUANLI_SPOT_MIN_RUN_S)
    for cluster_id, state, since, host_id, gpus, vcpus in rows:
        if state == Cluster.State.PREEMPTING:
            soon_g[host_id] += gpus
            soon_c[host_id] += vcpus
            continue
        if since is not None and since > protected_since:
            continue
        holder = holders.setdefault(cluster_id, SpotHolder(cluster_id, since, {}))
        had = holder.gives.get(host_id, (0, 0))
        holder.gives[host_id] = (had[0] + gpus, had[1] + vcpus)
    soon = {h: (soon_g[h], soon_c[h]) for h in soon_g.keys() | soon_c.keys()}
    return list(holders.values()), soon


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def reclaim_spot(clusters: list[Cluster], fleet: Fleet, report: PassReport) -> dict[int, Text]:
    """For each on-demand request that did not fit (the first in line per resource),
    preempt spot clusters, youngest first, until it fits, then drop again any whose
    capacity is not needed. Returns a reason per
    request to show while the capacity comes back."""
    holders, soon = _spot_capacity()
    if not holders and not soon:
        return {}
    notes: dict[int, Text] = {}
    # A request reclaims only once it has waited SUANLI_RECLAIM_AFTER_S: one that its
    # owner releases before that (a throw-away request, made to harass another tenant's
    # spot jobs) never preempts anybody.
    waited_since = timezone.now() - timedelta(seconds=settings.SUANLI_RECLAIM_AFTER_S)
    for cluster in clusters:
        hosts = fleet.usable_hosts(cluster)
        # GPUs being freed (lifecycle.free_nodes) come back on their own: when they are
        # enough, nobody is preempted and the request says it waits for them.
        freeing = {h.id: (h.freeing, 0) for h in hosts if h.freeing}
        if freeing and _WhatIf(hosts, freeing).fits(cluster):
            continue
        if cluster.queued_at > waited_since:
            notes[cluster.pk] = Text(
                gettext_noop(
                    "waiting; spot capacity is reclaimed for it after %(seconds)s s in line"
                ),
                seconds=settings.SUANLI_RECLAIM_AFTER_S,
            )
            continue
        coming = {h: _plus(soon.get(h, (0, 0)), freeing.get(h, (0, 0))) for h in {*soon, *freeing}}
        victims = choose_victims(cluster, hosts, coming, holders)
        if victims is None:
            continue
        for victim in victims:
            if lifecycle.cluster_preempt(
                cluster=Cluster(pk=victim.cluster_id),
                # No names: the requester and the preempted may be different tenants.
                reason=Text(gettext_noop("spot capacity reclaimed for an on-demand request")),
            ):
                report.preempted.append(victim.cluster_id)
        taken = {v.cluster_id for v in victims}
        holders = [h for h in holders if h.cluster_id not in taken]
        for victim in victims:  # coming back soon (a later request may wait for it too)
            for host_id, (g, c) in victim.gives.items():
                had = soon.get(host_id, (0, 0))
                soon[host_id] = (had[0] + g, had[1] + c)
        if not victims:
            notes[cluster.pk] = Text(gettext_noop("waiting for spot capacity being reclaimed"))
        elif len(victims) == 1:
            notes[cluster.pk] = Text(
                gettext_noop(
                    "waiting for spot capacity being reclaimed (1 spot cluster preempted for it)"
                )
            )
        else:
            notes[cluster.pk] = Text(
                gettext_noop(
                    "waiting for spot capacity being reclaimed (%(n)s spot clusters preempted "
                    "for it)"
                ),
                n=len(victims),
            )
    if report.preempted:
        log.info("preempted spot clusters %s", report.preempted)
    return notes
