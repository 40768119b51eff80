"""Nodes stranded on a failed host moved: off hosts that are degraded, or down for longer
than `SUANLI_HOST_DOWN_MOVE_S`, to active hosts with room (same shape, one network with the
cluster's other nodes); a cluster whose nodes fit nowhere keeps them, uncharged, and says
why. Runs first in every placement pass.

Layer: placement, over slots, under scheduler; uses slots, capacity, events (lifecycle,
timeline), models and base (queue, text).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.queue import enqueue_by_name
from jobs.base.text import Moment, Text, join
from jobs.events import lifecycle
from jobs.events.timeline import cluster_event, reason_fields
from jobs.models import Cluster, Host, Job, Node
from jobs.placement.capacity import Conflict, Fleet, PassReport, host_state, shortage
from jobs.placement.slots import format_indices, replace_node

# A running cluster's reason while nodes of it wait for room on another host: cleared when
# they move (_move) or their host is back (hosts.services._host_back).
TO_BE_MOVED = gettext_noop("%(nodes)s: to be moved to another host; %(why)s")


def _stranded(now) -> dict[int, list[Node]]:
    """Live nodes of running clusters on hosts they must leave: degraded hosts at once,
    down hosts once they have been down `SUANLI_HOST_DOWN_MOVE_S`. A cluster whose job is
    still starting or running waits for it to end (its lost replicas stop the job)."""
    down_before = now - timedelta(seconds=settings.SUANLI_HOST_DOWN_MOVE_S)
    nodes = (
        Node.objects.filter(released_at__isnull=True, cluster__state=Cluster.State.RUNNING)
        # Without GPUs its workspaces live on that host only: they wait for it to come back.
        .exclude(cluster__no_gpu=True)
        .filter(
            models.Q(host__state=Host.State.DEGRADED)
            | models.Q(host__state=Host.State.DOWN, host__unhealthy_since__lte=down_before)
        )
        .exclude(cluster__jobs__state__in=Job.ACTIVE)
        .select_related("host")
        .order_by("cluster_id", "index")
    )
    out: dict[int, list[Node]] = defaultdict(list)
    for node in nodes:
        out[node.cluster_id].append(node)
    return out


def move_stranded(fleet: Fleet, report: PassReport, *, now=None) -> int:
    """Move nodes off hosts that are degraded, or down for longer than the setting, to
    active hosts with room (same shape, one network with the cluster's other nodes). A
    cluster whose nodes fit nowhere keeps them and says why; it is tried again each pass."""
    now = now or timezone.now()
    moved = 0
    for cluster_id, nodes in _stranded(now).items():
        cluster = Cluster.objects.select_related("gpu_model", "instance_type").get(pk=cluster_id)
        hosts, why = _plan_move(cluster, nodes, fleet)
        if hosts is None:
            _say_waiting(cluster, nodes, why, now)
            continue
        try:
            if not _move(cluster, nodes, hosts, fleet, now):
                continue
        except Conflict:
            report.conflicts += 1
            continue
        for host_id in hosts:
            fleet.take(
                host_id,
                cluster.gpus_per_node,
                cluster.instance_type.vcpus if cluster.is_cpu_only else 0,
            )
        moved += len(hosts)
        enqueue_by_name("jobs.tasks.cluster_network_ensure", cluster_id, job_id=f"net-{cluster_id}")
    return moved


def _plan_move(
    cluster: Cluster, nodes: list[Node], fleet: Fleet
) -> tuple[list[int] | None, Text | None]:
    """A host per stranded node (same shape; only hosts that can share a network with the
    nodes that stay), or (None, why they wait)."""
    staying = list(
        Node.objects.filter(cluster_id=cluster.pk, released_at__isnull=True)
        .exclude(pk__in=[n.pk for n in nodes])
        .values_list("host_id", flat=True)
    )
    extra = Cluster(
        pk=cluster.pk, gpu_model=cluster.gpu_model, instance_type=cluster.instance_type,
        gpus_per_node=cluster.gpus_per_node, nodes=len(nodes), network=cluster.network,
        zone=cluster.zone,
    )  # fmt: skip
    # Only hosts that can share a network with the nodes that stay.
    fits = (
        Fleet([replace(c) for c in fleet.hosts.values() if fleet.one_network([*staying, c.id])])
        if staying
        else fleet
    )
    hosts = fits.plan(extra)
    if hosts is None:
        return None, shortage(extra, fleet)
    if not fleet.one_network(staying + hosts):
        return None, Text(
            gettext_noop("the hosts with room cannot share a network with its other nodes")
        )
    return hosts, None


def _say_waiting(cluster: Cluster, nodes: list[Node], why: Text, now) -> None:
    """Stranded nodes that fit nowhere now: no longer charged while they wait for room, and
    the cluster says why (once)."""
    where = join(
        [
            Text(
                gettext_noop("node %(index)s on %(host)s (%(state)s)"),
                index=n.index,
                host=n.host.name,
                state=host_state(n.host.state),
            )
            for n in nodes
        ]
    )
    waiting = Text(TO_BE_MOVED, nodes=where, why=why)
    said = reason_fields(Cluster, waiting)
    with transaction.atomic():
        # Waiting for room is not charged (a down host's nodes are not already).
        Node.objects.filter(pk__in=[n.pk for n in nodes], lost_at__isnull=True).update(lost_at=now)
        if (
            Cluster.objects.filter(pk=cluster.pk)
            .exclude(state_reason=said["state_reason"])
            .update(**said)
        ):
            cluster_event(cluster, "waiting", waiting, at=now)


def _move(cluster: Cluster, nodes: list[Node], hosts: list[int], fleet: Fleet, now) -> bool:
    """Give the stranded nodes new rows on `hosts`, in one transaction with the cluster
    locked, and say where they went; False when the cluster no longer runs idle or its
    nodes have gone meanwhile. Raises Conflict, writing nothing, when the room is gone."""
    with transaction.atomic():
        locked = Cluster.objects.select_for_update().get(pk=cluster.pk)
        if (
            locked.state != Cluster.State.RUNNING
            or locked.jobs.filter(state__in=Job.ACTIVE).exists()
        ):
            return False
        fresh = [
            n for n in nodes if Node.objects.filter(pk=n.pk, released_at__isnull=True).exists()
        ]
        pairs = [
            (node, replace_node(node, host_id=host_id, now=now))
            for node, host_id in zip(fresh, hosts, strict=False)
        ]
        pairs = [(old, new) for old, new in pairs if new is not None]
        if not pairs:
            return False
        fresh, placed = [p[0] for p in pairs], [p[1] for p in pairs]
        names = {h: cap.name for h, cap in fleet.hosts.items()}
        moves = [_moved(old, new, names) for old, new in zip(fresh, placed, strict=True)]
        message = moves[-1]
        for move in reversed(moves[:-1]):
            message = Text(gettext_noop("%(first)s; %(rest)s"), first=move, rest=message)
        Cluster.objects.filter(pk=cluster.pk).update(
            **reason_fields(Cluster, ""), last_active_at=now
        )
        cluster_event(cluster, "moved", message, at=now)
        lifecycle.request_dispatch(cluster.pk)
    return True


def _moved(old: Node, new: Node, names: dict[int, str]) -> Text:
    """ "node 0 moved from host-a (down since 12:00:00 UTC) to host-b GPU 0-7"."""
    args = {
        "index": old.index,
        "old": old.host.name,
        "state": host_state(old.host.state),
        "new": names.get(new.host_id, new.host_id),
    }
    if old.host.unhealthy_since:
        args["since"] = Moment(old.host.unhealthy_since, "%H:%M:%S")
    if new.gpu_indices:
        args["gpus"] = format_indices(new.gpu_indices)
    if "since" in args and "gpus" in args:
        msgid = gettext_noop(
            "node %(index)s moved from %(old)s (%(state)s since %(since)s) to %(new)s GPU %(gpus)s"
        )
    elif "since" in args:
        msgid = gettext_noop(
            "node %(index)s moved from %(old)s (%(state)s since %(since)s) to %(new)s"
        )
    elif "gpus" in args:
        msgid = gettext_noop(
            "node %(index)s moved from %(old)s (%(state)s) to %(new)s GPU %(gpus)s"
        )
    else:
        msgid = gettext_noop("node %(index)s moved from %(old)s (%(state)s) to %(new)s")
    return Text(msgid, **args)
