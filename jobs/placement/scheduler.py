"""Gang placement of pending clusters onto hosts.

A pass loads the free capacity of every active host once (three queries), then walks the
queue in fair-share order (`fairshare`: accounts that used less of their share recently
first, first come, first served within an account, none starved past
SUANLI_FAIRSHARE_MAX_WAIT_H) and plans each cluster in memory:

* **GPU limit**: a team's request that would pass its operator-set GPU limit waits, skipped
  (not a head of line), so the requests behind it are placed as if it were not there.

* **Gang**: all nodes of a cluster are placed, or none.
* **Best fit**: each node goes to the host with the fewest free GPUs that still fit it, so
  whole hosts stay free for large requests. Free counts are kept in buckets (0..16 free),
  so finding that host costs a few set look-ups whatever the fleet's size.
* **One zone first**: nodes are kept in one zone when they fit there (spreading costs
  about 5 % in communication); RDMA clusters never spread.
* **On-demand first**: on-demand requests are in line before spot ones (fair share within each),
  so capacity reclaimed from spot clusters goes to the request it was reclaimed for.
* **Fairness**: the first cluster in line for a resource (a GPU model or a CPU type) that
  does not fit *reserves* every host it could use for the rest of the pass. Newer requests
  for that resource are placed only on hosts the head cannot use, so a stream of small
  requests can never starve it.

* **One network**: the nodes of a cluster that spans hosts share an overlay network of the
  hosts' Docker swarm, so they are placed on members of one swarm; a host outside a swarm
  takes a multi-node cluster only when all of its nodes fit on that host (one bridge).

* **Reclaim**: the first on-demand request of a resource that does not fit preempts running
  spot clusters, youngest first, until it fits, and spares those it turns out not to need
  (`reclaim_spot`; greedy, so not always the smallest set).

A plan is committed in its own transaction that locks the chosen GPU slots with
`SELECT ... FOR UPDATE SKIP LOCKED` and re-checks they are still free; if another
scheduler got there first, nothing of the cluster is written and it is planned again.

Where each part lives: `capacity` (the Fleet and the plan of one cluster), `slots` (nodes
written with their slots locked), `restart` (stopped clusters starting again), `stranded`
(nodes moved off failed hosts, first in every pass), `reclaim` (spot capacity reclaimed).
This module is the pass (`place_pending`) and the writing of its plans (`_commit_batch`).

Layer: placement, under runs. Uses lifecycle (a victim's preemption, a placed cluster's
dispatch), timeline (its lines and their webhooks), models, queue and sql; the network of a
placed cluster is made by task name ("jobs.tasks.cluster_network_ensure").
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base import metrics
from jobs.base.queue import enqueue_many_by_name
from jobs.base.sql import update_rows
from jobs.base.text import Text, argument, stored_reason
from jobs.events import lifecycle, timeline
from jobs.events.timeline import reason_fields, set_reason
from jobs.models import Cluster, Job, Node, Team
from jobs.placement import fairshare
from jobs.placement.capacity import Fleet, PassReport, resource_key, shortage
from jobs.placement.reclaim import reclaim_spot
from jobs.placement.restart import carry_saves, plan_kept, started_elsewhere
from jobs.placement.slots import (
    assign_slots,
    lock_cpu_capacity,
    lock_free_slots,
    placed_text,
    preferring,
)
from jobs.placement.stranded import move_stranded

log = logging.getLogger(__name__)


BATCH = 500  # plans written per transaction (each commit waits for a WAL flush)


def _commit_batch(
    batch: list[tuple[Cluster, list[int]]], fleet: Fleet, report: PassReport, *, now=None
) -> None:
    """Write planned placements in one transaction, a handful of statements in all.

    The clusters are claimed (still pending, and not being placed by another scheduler)
    and the slots of their hosts locked with FOR UPDATE SKIP LOCKED; each cluster then
    takes its slots from what is really free. A cluster whose capacity is gone (another
    scheduler took it) is left pending, whole, for the next pass.
    """
    now = now or timezone.now()
    with transaction.atomic():
        claimed = set(
            Cluster.objects.select_for_update(skip_locked=True)
            .filter(pk__in=[c.pk for c, _ in batch], state=Cluster.State.PENDING)
            .values_list("pk", flat=True)
        )
        # Stopped clusters starting again: their kept nodes, by node index.
        kept_of: dict[int, list[Node]] = defaultdict(list)
        for kept_node in (
            Node.objects.filter(
                cluster_id__in=[c.pk for c, _ in batch if c.stopped_at is not None],
                stopped_at__isnull=False, kept_until__isnull=True,
            ).select_related("host").order_by("cluster_id", "index")
        ):  # fmt: skip
            kept_of[kept_node.cluster_id].append(kept_node)
        claimed -= _past_limits([c for c, _ in batch if c.pk in claimed], report)
        placed, slots_of = _take_slots(
            [(c, hosts) for c, hosts in batch if c.pk in claimed], kept_of, now, report
        )
        if not placed:
            return
        nodes = [node for _, mine in placed for node in mine]
        Node.objects.bulk_create(nodes)
        assign_slots(
            [(slot, node.pk) for node, ids in zip(nodes, slots_of, strict=True) for slot in ids]
        )
        Cluster.objects.filter(pk__in=[c.pk for c, _ in placed]).update(
            state=Cluster.State.RUNNING, **reason_fields(Cluster, ""),
            running_since=now, last_active_at=now, stopped_at=None, release_warned_at=None,
            no_gpu=False,
        )  # fmt: skip
        _say_placed(placed, kept_of, fleet, now)
    for cluster, _ in placed:
        cluster.state = Cluster.State.RUNNING
        report.placed.append(cluster.pk)
    # Their networks now, before any job: by dotted name (the runner sits above us), in one
    # Redis round trip for the batch.
    enqueue_many_by_name(
        "jobs.tasks.cluster_network_ensure", [((c.pk,), f"net-{c.pk}") for c, _ in placed]
    )
    metrics.placed([c for c, _ in placed], now)  # placements and their time in the queue
    waiting = Job.objects.filter(cluster_id__in=[c.pk for c, _ in placed], state__in=Job.WAITING)
    for cluster_id in set(waiting.values_list("cluster_id", flat=True)):
        lifecycle.request_dispatch(cluster_id)  # jobs submitted while the cluster was pending


def _past_limits(clusters: list[Cluster], report: PassReport) -> set[int]:
    """The claimed clusters that would pass their team's GPU limit once what other
    schedulers placed meanwhile is counted: the limited teams' rows are locked (one writer
    at a time places for such a team) and their live GPUs counted again. Those are left
    pending for the next pass (conflicts)."""
    owners = {c.owner_id for c in clusters if c.total_gpus}
    limits = dict(
        Team.objects.select_for_update()
        .filter(principal_id__in=owners, gpu_limit__isnull=False)
        .order_by("pk")
        .values_list("principal_id", "gpu_limit")
    )
    if not limits:
        return set()
    held = dict(
        Node.objects.filter(released_at__isnull=True, no_gpu=False, cluster__owner_id__in=limits)
        .values_list("cluster__owner_id")
        .annotate(n=Sum("cluster__gpus_per_node"))
    )
    out = set()
    for cluster in clusters:
        owner = cluster.owner_id
        if owner not in limits or not cluster.total_gpus:
            continue
        if held.get(owner, 0) + cluster.total_gpus > limits[owner]:
            out.add(cluster.pk)
            report.conflicts += 1
        else:
            held[owner] = held.get(owner, 0) + cluster.total_gpus
    return out


def _take_slots(
    batch: list[tuple[Cluster, list[int]]], kept_of: dict[int, list[Node]], now, report
) -> tuple[list[tuple[Cluster, list[Node]]], list[list[int]]]:
    """The claimed clusters' nodes (unsaved), each taking its GPU slots and vCPUs from what
    is really free on its hosts, locked for this transaction (a stopped cluster its own
    GPUs first); a cluster whose capacity is gone is counted as a conflict and left out,
    whole. Returns the placed clusters with their nodes, and each node's slot ids."""
    gpu_hosts = {h for c, hosts in batch if c.gpus_per_node for h in hosts}
    free = lock_free_slots(gpu_hosts)
    cpu_hosts = {h for c, hosts in batch if c.is_cpu_only for h in hosts}
    cpu_free = lock_cpu_capacity(cpu_hosts) if cpu_hosts else {}
    slots_of: list[list[int]] = []
    placed: list[tuple[Cluster, list[Node]]] = []
    for cluster, hosts in batch:
        gpus = cluster.gpus_per_node
        vcpus = cluster.instance_type.vcpus if cluster.is_cpu_only else 0
        need: dict[int, int] = defaultdict(int)
        for host_id in hosts:
            need[host_id] += 1
        if any(len(free[h]) < n * gpus for h, n in need.items()) or any(
            cpu_free.get(h, 0) < n * vcpus for h, n in need.items() if vcpus
        ):
            report.conflicts += 1
            continue
        mine = []
        kept = kept_of.get(cluster.pk, [])
        for index, host_id in enumerate(hosts):
            if index < len(kept) and kept[index].gpu_indices and kept[index].host_id == host_id:
                free[host_id] = preferring(free[host_id], kept[index].gpu_indices)
            taken, free[host_id] = free[host_id][:gpus], free[host_id][gpus:]
            if vcpus:
                cpu_free[host_id] -= vcpus
            mine.append(
                Node(
                    cluster=cluster,
                    index=index,
                    host_id=host_id,
                    gpu_indices=[i for _, i in taken],
                    vcpus=vcpus,
                    placed_at=now,
                )
            )
            slots_of.append([slot_id for slot_id, _ in taken])
        placed.append((cluster, mine))
    return placed, slots_of


def _say_placed(
    placed: list[tuple[Cluster, list[Node]]], kept_of: dict[int, list[Node]], fleet: Fleet, now
) -> None:
    """Each placed cluster's running event (and webhook), in the placement's transaction;
    those that were stopped run again on the hosts that keep their workspaces, or elsewhere
    with their saves (`restart.plan_elsewhere`), carried to their new nodes here."""
    names = {h: cap.name for h, cap in fleet.hosts.items()}
    texts = {}
    for c, mine in placed:
        if c.pk in kept_of:
            carry_saves(kept_of[c.pk], mine)
            moved = started_elsewhere(kept_of[c.pk], mine, names)
            if moved is not None:
                texts[c.pk] = Text(
                    gettext_noop("placed: %(nodes)s; your files and system disk came along"),
                    nodes=moved,
                )
    timeline.cluster_events(
        [(c, "running", texts.get(c.pk) or placed_text(mine, names)) for c, mine in placed],
        at=now,
    )


# A preempted cluster waiting again keeps saying why it was preempted, before where it is.
REQUEUED = gettext_noop("preempted (%(reason)s); %(why)s")


def _preempted_for(cluster: Cluster) -> Text | str:
    """The reason inside a preempted cluster's "preempted (...); ..." (its state reason)."""
    said = stored_reason(cluster)
    for msgid in (lifecycle.PREEMPTED, REQUEUED):
        inner = argument(said, msgid)
        if inner is not None:
            return inner
    return str(said).split("); ", 1)[0].removeprefix("preempted (")  # plain words


def _set_reason_if_new(cluster: Cluster, reason: Text, *, always: bool = False) -> bool:
    """Set the (unsaved) cluster's state reason and its twin; False when it said that
    already (unless `always`)."""
    if cluster.state_reason == reason_fields(Cluster, reason)["state_reason"] and not always:
        return False
    set_reason(cluster, reason)
    return True


def place_pending(*, fleet: Fleet | None = None, now: datetime | None = None) -> PassReport:
    """One pass over the queue, in fair-share order (fairshare.py). Safe to run twice, and
    by several workers at once. `now`: the pass's time (a simulation's; default: now)."""
    fleet = fleet or Fleet.load()
    given, now = now, now or timezone.now()
    report = PassReport()
    # Running clusters stranded on a failed host go first: they were placed before anything
    # in the queue, and their researchers are waiting on them now.
    report.moved = move_stranded(fleet, report)
    heads: dict[str, Cluster] = {}
    on_demand_heads: dict[str, Cluster] = {}  # the first on-demand request that did not fit
    reasons: list[Cluster] = []
    pending = list(
        Cluster.objects.filter(state=Cluster.State.PENDING)
        .select_related("gpu_model", "instance_type", "image")
        .order_by("spot", "queued_at", "id")
    )
    accounts = fairshare.standing(pending, now=now, fleet_gpus=fleet.gpus())
    batch: list[tuple[Cluster, list[int]]] = []
    for cluster in accounts.order(pending):
        key = resource_key(cluster)
        limit = accounts.over_limit(cluster)
        if limit is not None:
            # Skipped, not a head of line: the requests behind it go on as if it were not there.
            report.waiting += 1
            if _set_reason_if_new(cluster, limit):
                reasons.append(cluster)
            continue
        if cluster.stopped_at is not None:
            # A stopped cluster waiting to start again: only on the hosts that keep its
            # workspaces. Those hosts are held for it while it waits (not the whole pool).
            hosts, why = plan_kept(cluster, fleet)
            if hosts is None:
                report.waiting += 1
                if why and _set_reason_if_new(cluster, why):
                    reasons.append(cluster)
                continue
        else:
            hosts = fleet.plan(cluster)
        if hosts is not None:
            # Count the capacity as taken now; the batch is written a little later.
            for host_id in hosts:
                fleet.take(
                    host_id,
                    cluster.gpus_per_node,
                    cluster.instance_type.vcpus if cluster.is_cpu_only else 0,
                )
            accounts.took(cluster)
            batch.append((cluster, hosts))
            if len(batch) >= BATCH:
                _commit_batch(batch, fleet, report, now=given)
                batch = []
            continue
        report.waiting += 1
        if not cluster.spot and key not in on_demand_heads:
            on_demand_heads[key] = cluster
        if _set_reason_if_new(cluster, _in_line(cluster, fleet, heads, key)):
            reasons.append(cluster)
    if batch:
        _commit_batch(batch, fleet, report, now=given)
    if on_demand_heads:
        _reclaim_for(list(on_demand_heads.values()), fleet, report, reasons)
    _write_reasons(reasons)
    if report.placed:
        log.info("placed %d cluster(s), %d waiting", len(report.placed), report.waiting)
    fairshare.passed()  # the pages' kept standings (fairshare.recall) are of an earlier pass
    return report


def _write_reasons(clusters: list[Cluster]) -> None:
    """The waiting clusters' new reasons, in one statement. Only rows still pending: a
    cluster placed or released meanwhile keeps its state (their rows are locked, in one
    order, and read again first)."""
    if not clusters:
        return
    with transaction.atomic():
        still = set(
            Cluster.objects.select_for_update()
            .filter(pk__in=[c.pk for c in clusters], state=Cluster.State.PENDING)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        update_rows(
            Cluster, "id", ["state_reason", "state_reason_text"],
            [(c.pk, c.state_reason, c.state_reason_text) for c in clusters if c.pk in still],
        )  # fmt: skip


def _in_line(cluster: Cluster, fleet: Fleet, heads: dict[str, Cluster], key: str) -> Text:
    """Why a cluster that does not fit waits, and where it is in line for its resource. The
    first in line (the head) reserves every host it could use for the rest of the pass."""
    why = shortage(cluster, fleet)  # before the head reserves what it could use
    head = heads.get(key)
    if head is None:
        heads[key] = cluster
        fleet.reserve_for(cluster)
        reason = Text(
            gettext_noop("%(why)s; first in line for %(resource)s"),
            why=why,
            resource=cluster.resource_label,
        )
    else:
        reason = Text(
            gettext_noop("%(why)s; behind %(head)s (first in line for %(resource)s)"),
            why=why,
            head=head.name,
            resource=cluster.resource_label,
        )
    if cluster.state_reason.startswith("preempted ("):  # keep saying why it waits again
        reason = Text(REQUEUED, reason=_preempted_for(cluster), why=reason)
    return reason


def _reclaim_for(
    heads: list[Cluster], fleet: Fleet, report: PassReport, reasons: list[Cluster]
) -> None:
    """Spot capacity reclaimed for the on-demand heads that did not fit; each says that it
    waits for it (added to `reasons`, the clusters whose reason is written)."""
    notes = reclaim_spot(heads, fleet, report)
    listed = {c.pk for c in reasons}
    for cluster in heads:
        if cluster.pk in notes:
            _set_reason_if_new(cluster, notes[cluster.pk], always=True)
            if cluster.pk not in listed:
                reasons.append(cluster)
