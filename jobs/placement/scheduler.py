"""Gang placement of pending clusters onto hosts.

A pass loads the free capacity of every active host once (three queries), then walks the
queue first-in-first-out and plans each cluster in memory:

* **Gang**: all nodes of a cluster are placed, or none.
* **Best fit**: each node goes to the host with the fewest free GPUs that still fit it, so
  whole hosts stay free for large requests. Free counts are kept in buckets (0..16 free),
  so finding that host costs a few set look-ups whatever the fleet's size.
* **One zone first**: nodes are kept in one zone when they fit there (spreading costs
  about 5 % in communication); RDMA clusters never spread.
* **On-demand first**: on-demand requests are in line before spot ones (FIFO within each),
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

Layer: scheduler (placement and reclaim policy), under runner. Uses lifecycle (a victim's
preemption, a placed cluster's dispatch), webhooks, models, queue and sql; the network of
a placed cluster is made by task name ("jobs.tasks.cluster_network_ensure").
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.db.models import Count, Sum
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.queue import enqueue_by_name
from jobs.base.sql import update_rows
from jobs.base.text import Moment, Text, argument, join, stored_reason
from jobs.events import lifecycle, webhooks
from jobs.models import MAX_GPUS_PER_HOST, Cluster, ClusterEvent, GpuSlot, Host, Job, Node

log = logging.getLogger(__name__)


@dataclass
class HostCap:
    id: int
    name: str
    zone: str
    rdma: bool
    gpu_model_id: int | None
    gpu_total: int
    free: int
    cpu_total: int
    cpu_free: int
    swarm: str = ""  # the ID of the Docker swarm it is a member of, "" outside one
    freeing: int = 0  # GPUs ended nodes still hold until the engine confirms (not free)


@dataclass
class PassReport:
    placed: list[int] = field(default_factory=list)
    waiting: int = 0
    conflicts: int = 0
    preempted: list[int] = field(default_factory=list)
    moved: int = 0


class Conflict(Exception):
    """Another scheduler took capacity this plan counted on."""


def _pool_key(cap: HostCap) -> tuple:
    return (cap.gpu_model_id, cap.zone, cap.rdma, cap.swarm)


def _by_swarm(items, swarm_of) -> dict[str, list]:
    groups: dict[str, list] = defaultdict(list)
    for item in items:
        groups[swarm_of(item)].append(item)
    return groups


class Fleet:
    """Free capacity of the active hosts, in memory, for one pass."""

    def __init__(self, hosts: list[HostCap]):
        self.hosts: dict[int, HostCap] = {h.id: h for h in hosts}
        # pool -> free count -> host ids; only GPU hosts are bucketed.
        self.buckets: dict[tuple, list[set[int]]] = defaultdict(
            lambda: [set() for _ in range(MAX_GPUS_PER_HOST + 1)]
        )
        self.reserved: dict[str, set[int]] = defaultdict(set)
        for cap in hosts:
            if cap.gpu_model_id is not None:
                self.buckets[_pool_key(cap)][cap.free].add(cap.id)

    @classmethod
    def load(cls, host_ids=None) -> Fleet:
        """The active hosts (only those of `host_ids` when given: one cluster's page)."""
        only = {} if host_ids is None else {"host_id__in": list(host_ids)}
        free = dict(
            GpuSlot.objects.filter(host__state=Host.State.ACTIVE, node__isnull=True, **only)
            .values_list("host_id")
            .annotate(n=Count("id"))
        )
        freeing = dict(
            GpuSlot.objects.filter(
                host__state=Host.State.ACTIVE, node__released_at__isnull=False, **only
            )
            .values_list("host_id")
            .annotate(n=Count("id"))
        )
        cpu_used = dict(
            Node.objects.filter(
                released_at__isnull=True, vcpus__gt=0, host__state=Host.State.ACTIVE, **only
            )
            .values_list("host_id")
            .annotate(n=Sum("vcpus"))
        )
        hosts = Host.objects.filter(state=Host.State.ACTIVE)
        if host_ids is not None:
            hosts = hosts.filter(id__in=list(host_ids))
        rows = hosts.values_list(
            "id", "name", "zone", "rdma", "gpu_model_id", "gpu_count", "cpu_count",
            "swarm_state", "swarm_cluster",
        )  # fmt: skip
        return cls(
            [
                HostCap(
                    id=i,
                    name=name,
                    zone=zone,
                    rdma=rdma,
                    gpu_model_id=model,
                    gpu_total=gpus,
                    free=free.get(i, 0),
                    cpu_total=cpus or 0,
                    cpu_free=(cpus or 0) - (cpu_used.get(i) or 0),
                    swarm=swarm if state == "active" else "",
                    freeing=freeing.get(i, 0),
                )
                for i, name, zone, rdma, model, gpus, cpus, state, swarm in rows
            ]
        )

    # -- what a cluster may use ------------------------------------------------------
    def pools_for(self, cluster: Cluster) -> dict[str, list[tuple]]:
        """Matching GPU pools, grouped by zone."""
        zones: dict[str, list[tuple]] = defaultdict(list)
        for key in self.buckets:
            model, zone, rdma, _ = key
            if model != cluster.gpu_model_id:
                continue
            if cluster.zone and zone != cluster.zone:
                continue
            if cluster.network == Cluster.Network.RDMA and not rdma:
                continue
            zones[zone].append(key)
        return zones

    def usable_hosts(self, cluster: Cluster) -> list[HostCap]:
        """Every active host that could ever hold a node of this cluster."""
        out = []
        for cap in self.hosts.values():
            if cluster.zone and cap.zone != cluster.zone:
                continue
            if cluster.is_cpu_only:
                if cap.cpu_total >= cluster.instance_type.vcpus:
                    out.append(cap)
                continue
            if cap.gpu_model_id != cluster.gpu_model_id or cap.gpu_total < cluster.gpus_per_node:
                continue
            if cluster.network == Cluster.Network.RDMA and not cap.rdma:
                continue
            out.append(cap)
        return out

    # -- planning ---------------------------------------------------------------------
    def _fit_gpu(self, pools: list[tuple], nodes: int, gpus: int) -> list[int] | None:
        overlay: dict[int, int] = {}  # hosts this plan already uses -> their free count after it
        chosen: list[int] = []
        for _ in range(nodes):
            best: tuple[int, int] | None = None  # (free, host id)
            for host_id, left in overlay.items():
                if left >= gpus and (best is None or left < best[0]):
                    best = (left, host_id)
            for key in pools:
                buckets = self.buckets[key]
                top = best[0] if best else MAX_GPUS_PER_HOST + 1
                for free in range(gpus, top):
                    # Reserved hosts are out of the buckets already (reserve_for).
                    host_id = next((h for h in buckets[free] if h not in overlay), None)
                    if host_id is not None:
                        best = (free, host_id)
                        break
            if best is None:
                return None
            overlay[best[1]] = best[0] - gpus
            chosen.append(best[1])
        return chosen

    def _fit_cpu(
        self, hosts: list[HostCap], nodes: int, vcpus: int, reserved: set[int]
    ) -> list[int] | None:
        left = {h.id: h.cpu_free for h in hosts if h.id not in reserved}
        chosen = []
        for _ in range(nodes):
            fits = [(free, hid) for hid, free in left.items() if free >= vcpus]
            if not fits:
                return None
            free, hid = min(fits)
            left[hid] = free - vcpus
            chosen.append(hid)
        return chosen

    def one_network(self, host_ids) -> bool:
        """Whether nodes on these hosts can share one network: one host, or members of one
        swarm."""
        hosts = set(host_ids)
        swarms = {self.hosts[h].swarm if h in self.hosts else "" for h in hosts}
        return len(hosts) <= 1 or (len(swarms) == 1 and "" not in swarms)

    def _fit_gpu_networked(self, pools: list[tuple], nodes: int, gpus: int) -> list[int] | None:
        """`_fit_gpu` that keeps a multi-node cluster on one network: across members of one
        swarm, or all on one host outside a swarm. The tightest fit of those wins."""
        if nodes == 1:
            return self._fit_gpu(pools, 1, gpus)
        best: tuple[int, list[int]] | None = None
        for swarm, keys in _by_swarm(pools, lambda key: key[3]).items():
            if swarm:
                chosen = self._fit_gpu(keys, nodes, gpus)
            else:
                one = self._fit_gpu(keys, 1, nodes * gpus)
                chosen = one * nodes if one else None
            if chosen is not None:
                leftover = sum(self.hosts[h].free for h in set(chosen)) - nodes * gpus
                if best is None or leftover < best[0]:
                    best = (leftover, chosen)
        return best[1] if best else None

    def _fit_cpu_networked(
        self, hosts: list[HostCap], nodes: int, vcpus: int, reserved: set[int]
    ) -> list[int] | None:
        if nodes == 1:
            return self._fit_cpu(hosts, 1, vcpus, reserved)
        for swarm, group in _by_swarm(hosts, lambda cap: cap.swarm).items():
            if swarm:
                chosen = self._fit_cpu(group, nodes, vcpus, reserved)
            else:
                one = self._fit_cpu(group, 1, nodes * vcpus, reserved)
                chosen = one * nodes if one else None
            if chosen is not None:
                return chosen
        return None

    def plan(self, cluster: Cluster) -> list[int] | None:
        """Host id per node (index order), or None when the cluster does not fit now."""
        reserved = self.reserved[resource_key(cluster)]
        if cluster.is_cpu_only:
            by_zone: dict[str, list[HostCap]] = defaultdict(list)
            for cap in self.usable_hosts(cluster):
                by_zone[cap.zone].append(cap)
            vcpus = cluster.instance_type.vcpus
            options = [
                self._fit_cpu_networked(hosts, cluster.nodes, vcpus, reserved)
                for hosts in by_zone.values()
            ]
            options = [o for o in options if o]
            if options:
                return options[0]
            if not cluster.zone:
                return self._fit_cpu_networked(
                    [h for hs in by_zone.values() for h in hs], cluster.nodes, vcpus, reserved
                )
            return None
        zones = self.pools_for(cluster)
        best: tuple[int, list[int]] | None = None
        for pools in zones.values():
            chosen = self._fit_gpu_networked(pools, cluster.nodes, cluster.gpus_per_node)
            if chosen is not None:
                leftover = sum(self.hosts[h].free for h in set(chosen)) - cluster.total_gpus
                if best is None or leftover < best[0]:
                    best = (leftover, chosen)
        if best is not None:
            return best[1]
        if not cluster.zone and cluster.network == Cluster.Network.STANDARD and len(zones) > 1:
            return self._fit_gpu_networked(
                [k for pools in zones.values() for k in pools], cluster.nodes, cluster.gpus_per_node
            )
        return None

    # -- bookkeeping after a commit -------------------------------------------------------
    def _rebucket(self, cap: HostCap, free: int) -> None:
        bucket = self.buckets[_pool_key(cap)]
        bucket[cap.free].discard(cap.id)
        cap.free = free
        if cap.id not in self.reserved[f"gpu:{cap.gpu_model_id}"]:
            bucket[cap.free].add(cap.id)

    def take(self, host_id: int, gpus: int, vcpus: int = 0) -> None:
        cap = self.hosts[host_id]
        if gpus:
            self._rebucket(cap, cap.free - gpus)
        cap.cpu_free -= vcpus

    def set_free(self, host_id: int, free: int) -> None:
        cap = self.hosts.get(host_id)
        if cap is not None and cap.gpu_model_id is not None:
            self._rebucket(cap, free)

    def hold(self, host_ids, key: str) -> None:
        """Keep these hosts for one waiting cluster: later requests of its resource in this
        pass do not take them."""
        for host_id in set(host_ids):
            cap = self.hosts.get(host_id)
            if cap is None:
                continue
            self.reserved[key].add(host_id)
            if cap.gpu_model_id is not None:
                self.buckets[_pool_key(cap)][cap.free].discard(host_id)

    def reserve_for(self, cluster: Cluster) -> None:
        hosts = self.usable_hosts(cluster)
        self.reserved[resource_key(cluster)].update(h.id for h in hosts)
        if not cluster.is_cpu_only:
            for cap in hosts:
                self.buckets[_pool_key(cap)][cap.free].discard(cap.id)

    def room(self, cluster: Cluster) -> tuple[int, int]:
        """(nodes that would fit now one by one, GPUs or vCPUs free) on usable, unreserved hosts."""
        reserved = self.reserved[resource_key(cluster)]
        hosts = [h for h in self.usable_hosts(cluster) if h.id not in reserved]
        if cluster.is_cpu_only:
            need = cluster.instance_type.vcpus
            return sum(max(h.cpu_free, 0) // need for h in hosts), sum(
                max(h.cpu_free, 0) for h in hosts
            )
        return sum(h.free // cluster.gpus_per_node for h in hosts), sum(h.free for h in hosts)


def plan_kept(cluster: Cluster, fleet: Fleet) -> tuple[list[int] | None, Text | None]:
    """Host per node (index order) for a stopped cluster that waits to start again on the
    hosts that keep its workspaces, or (None, why it waits). Hosts an earlier request in
    line holds are not used; those it waits for are held for it (`Fleet.hold`)."""
    key = resource_key(cluster)
    nodes = kept_nodes(cluster.pk)
    if not nodes:
        return None, Text(gettext_noop("keeps no workspaces: release it"))
    kept = [(n.host_id, n.host.name, n.host.state) for n in nodes]
    per_node = cluster.instance_type.vcpus if cluster.is_cpu_only else cluster.gpus_per_node
    need: dict[int, int] = defaultdict(int)
    for host_id, _, _ in kept:
        need[host_id] += per_node
    why = None
    cpu = cluster.is_cpu_only
    for host_id, name, state in kept:
        cap = fleet.hosts.get(host_id)
        if cap is None:
            why = why or Text(
                gettext_noop("waiting for host %(host)s, which keeps its workspaces (%(state)s)"),
                host=name,
                state=host_state(state),
            )
            continue
        free = cap.cpu_free if cpu else cap.free
        if host_id in fleet.reserved[key] and not why:
            why = Text(
                gettext_noop(
                    "waiting for vCPUs on %(host)s, which keeps its workspaces (held for an "
                    "earlier request)"
                )
                if cpu
                else gettext_noop(
                    "waiting for GPUs on %(host)s, which keeps its workspaces (held for an "
                    "earlier request)"
                ),
                host=name,
            )
        elif free < need[host_id] and not why:
            why = Text(
                gettext_noop(
                    "waiting for %(need)s vCPUs on %(host)s, which keeps its workspaces "
                    "(%(free)s free)"
                )
                if cpu
                else gettext_noop(
                    "waiting for %(need)s GPUs on %(host)s, which keeps its workspaces "
                    "(%(free)s free)"
                ),
                need=need[host_id],
                host=name,
                free=max(free, 0),
            )
    if why:
        elsewhere = plan_elsewhere(cluster, fleet, nodes)
        if elsewhere is not None:
            return elsewhere, None
        fleet.hold(need, key)
        if movable(nodes):
            why = Text(gettext_noop("%(why)s, nor room for it on another host"), why=why)
        return None, why
    return [host_id for host_id, _, _ in kept], None


def kept_nodes(cluster_id: int) -> list[Node]:
    """The nodes a stop of the cluster keeps (with their hosts), in index order."""
    return list(
        Node.objects.filter(
            cluster_id=cluster_id, stopped_at__isnull=False, kept_until__isnull=True
        )
        .select_related("host")
        .order_by("index")
    )


def movable(kept: list[Node]) -> bool:
    """Whether every kept node's root filesystem is saved in the registry (workspaces.save),
    so that the cluster may start on other hosts than those that keep its workspaces."""
    return bool(kept) and all(n.saved_image for n in kept)


def plan_elsewhere(
    cluster: Cluster, fleet: Fleet, kept: list[Node], *, saved: bool = True
) -> list[int] | None:
    """Host per node (index order) for a stopped cluster whose kept hosts have no room (or
    take no work), when it is `movable` (or would be: `saved=False`): wherever its shape
    fits (same GPU model, RDMA or not, one network), in its zone, or where it has none, in
    its kept hosts' zone first. A node stays on its own host where the plan uses that
    host. None when it cannot move or fits nowhere now."""
    if not kept or (saved and not movable(kept)):
        return None
    zones = [cluster.zone] if cluster.zone else [kept[0].host.zone, ""]
    for zone in dict.fromkeys(zones):
        shape = Cluster(
            pk=cluster.pk, gpu_model=cluster.gpu_model, instance_type=cluster.instance_type,
            gpus_per_node=cluster.gpus_per_node, nodes=len(kept), network=cluster.network,
            zone=zone,
        )  # fmt: skip
        hosts = fleet.plan(shape)
        if hosts is not None:
            return _own_hosts_first(kept, hosts)
    return None


def _own_hosts_first(kept: list[Node], hosts: list[int]) -> list[int]:
    left = list(hosts)
    out: list[int | None] = [None] * len(kept)
    for i, node in enumerate(kept):
        if node.host_id in left:
            out[i] = node.host_id
            left.remove(node.host_id)
    return [host if host is not None else left.pop(0) for host in out]


def started_elsewhere(kept: list[Node], nodes: list[Node], names: dict[int, str]) -> Text | None:
    """ "node 0 on host-b GPU 0-1 (host-a had no free GPUs), node 1 on host-a GPU 2-3" for a
    stopped cluster started again where some node left the host that kept it, or None when
    every node is back on its own host."""
    if all(new.host_id == old.host_id for old, new in zip(kept, nodes, strict=True)):
        return None
    parts = []
    for old, new in zip(kept, nodes, strict=True):
        where = names.get(new.host_id, f"host {new.host_id}")
        args = {"index": new.index, "host": where, "old": old.host.name}
        if new.gpu_indices:
            args["gpus"] = format_indices(new.gpu_indices)
        if new.host_id == old.host_id:
            parts.append(nodes_text([new], names))
        elif old.host.state != Host.State.ACTIVE:
            args["state"] = host_state(old.host.state)
            parts.append(
                Text(
                    gettext_noop("node %(index)s on %(host)s GPU %(gpus)s (%(old)s is %(state)s)")
                    if new.gpu_indices
                    else gettext_noop("node %(index)s on %(host)s (%(old)s is %(state)s)"),
                    **args,
                )
            )
        else:
            parts.append(
                Text(
                    gettext_noop(
                        "node %(index)s on %(host)s GPU %(gpus)s (%(old)s had no free GPUs)"
                    )
                    if new.gpu_indices
                    else gettext_noop("node %(index)s on %(host)s (%(old)s had no free vCPUs)"),
                    **args,
                )
            )
    return join(parts)


def carry_saves(kept: list[Node], nodes: list[Node]) -> list[Node]:
    """After a start of a stopped cluster: each new node made from its kept node's save
    (`Node.saved_image`) where it left that node's host, or where the kept node's workspace
    was never made (its files are in the save alone); the kept nodes no longer kept, and
    the workspace of one left behind named on it so that it is removed from that host once
    the new one runs (workspaces.ensure). Returns the kept nodes that moved."""
    moved = []
    for old, new in zip(kept, nodes, strict=True):
        if old.saved_image and (new.host_id != old.host_id or not old.workspace_container):
            Node.objects.filter(pk=new.pk).update(
                saved_image=old.saved_image, saved_layers=old.saved_layers
            )
            new.saved_image, new.saved_layers = old.saved_image, old.saved_layers
        if new.host_id != old.host_id:
            moved.append(old)
    stay = [o.pk for o in kept if o not in moved]
    now = nodes[0].placed_at if nodes else timezone.now()
    Node.objects.filter(pk__in=stay).update(kept_until=now, workspace_container="")
    Node.objects.filter(pk__in=[o.pk for o in moved]).update(kept_until=now)
    return moved


def resource_key(cluster: Cluster) -> str:
    return (
        f"cpu:{cluster.instance_type_id}" if cluster.is_cpu_only else f"gpu:{cluster.gpu_model_id}"
    )


def shortage_text(cluster: Cluster, fleet: Fleet) -> str:
    return str(shortage(cluster, fleet))


def shortage(cluster: Cluster, fleet: Fleet) -> Text:
    """Why the cluster does not fit now ("waiting for ..."), in the reader's language; with
    the GPUs being freed on the hosts it could use, where there are any."""
    why = _shortage(cluster, fleet)
    freeing = [h for h in fleet.usable_hosts(cluster) if h.freeing and not cluster.is_cpu_only]
    if not freeing:
        return why
    return Text(
        gettext_noop(
            "%(why)s; GPUs being freed on %(hosts)s: %(n)s (their last cluster's containers "
            "are being removed)"
        ),
        why=why,
        n=sum(h.freeing for h in freeing),
        hosts=", ".join(sorted(h.name for h in freeing)[:3]),
    )


def _shortage(cluster: Cluster, fleet: Fleet) -> Text:
    rdma = cluster.network == Cluster.Network.RDMA
    if cluster.zone:
        where = Text(
            gettext_noop("with RDMA in %(zone)s") if rdma else gettext_noop("in %(zone)s"),
            zone=cluster.zone,
        )
    else:
        where = Text(gettext_noop("with RDMA in any zone") if rdma else gettext_noop("in any zone"))
    if not fleet.usable_hosts(cluster):
        return Text(
            gettext_noop(
                "no active host %(where)s is large enough for a node of %(shape)s "
                "(hosts may be draining or down)"
            ),
            where=where,
            shape=cluster.shape,
        )
    fit, free = fleet.room(cluster)
    room = (
        Text(gettext_noop("room for no node now"))
        if fit == 0
        else Text(
            gettext_noop("room for %(fit)s of %(nodes)s nodes now"), fit=fit, nodes=cluster.nodes
        )
    )
    args = {"shape": cluster.shape, "where": where, "room": room, "free": free}
    if cluster.nodes > 1 and fit >= cluster.nodes:
        return Text(
            gettext_noop(
                "waiting for %(shape)s %(where)s; %(room)s (%(free)s vCPUs free); its nodes "
                "must share one network: hosts outside a Docker swarm take it only when all "
                "its nodes fit on one host"
            )
            if cluster.is_cpu_only
            else gettext_noop(
                "waiting for %(shape)s %(where)s; %(room)s (%(free)s GPUs free); its nodes "
                "must share one network: hosts outside a Docker swarm take it only when all "
                "its nodes fit on one host"
            ),
            **args,
        )
    return Text(
        gettext_noop("waiting for %(shape)s %(where)s; %(room)s (%(free)s vCPUs free)")
        if cluster.is_cpu_only
        else gettext_noop("waiting for %(shape)s %(where)s; %(room)s (%(free)s GPUs free)"),
        **args,
    )


BATCH = 100  # plans written per transaction


def _commit_batch(batch: list[tuple[Cluster, list[int]]], fleet: Fleet, report: PassReport) -> None:
    """Write planned placements in one transaction, a handful of statements in all.

    The clusters are claimed (still pending, and not being placed by another scheduler)
    and the slots of their hosts locked with FOR UPDATE SKIP LOCKED; each cluster then
    takes its slots from what is really free. A cluster whose capacity is gone (another
    scheduler took it) is left pending, whole, for the next pass.
    """
    now = timezone.now()
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
        gpu_hosts = {h for c, hosts in batch if c.gpus_per_node for h in hosts}
        free = _lock_free_slots(gpu_hosts)
        cpu_hosts = {h for c, hosts in batch if c.is_cpu_only for h in hosts}
        cpu_free = _lock_cpu_capacity(cpu_hosts) if cpu_hosts else {}

        nodes: list[Node] = []
        slots_of: list[list[int]] = []
        placed: list[tuple[Cluster, list[Node]]] = []
        for cluster, hosts in batch:
            if cluster.pk not in claimed:
                continue
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
                    free[host_id] = _preferring(free[host_id], kept[index].gpu_indices)
                taken, free[host_id] = free[host_id][:gpus], free[host_id][gpus:]
                if vcpus:
                    cpu_free[host_id] -= vcpus
                node = Node(
                    cluster=cluster,
                    index=index,
                    host_id=host_id,
                    gpu_indices=[i for _, i in taken],
                    vcpus=vcpus,
                    placed_at=now,
                )
                nodes.append(node)
                slots_of.append([slot_id for slot_id, _ in taken])
                mine.append(node)
            placed.append((cluster, mine))
        if not placed:
            return
        Node.objects.bulk_create(nodes)
        _assign_slots(
            [(slot, node.pk) for node, ids in zip(nodes, slots_of, strict=True) for slot in ids]
        )
        Cluster.objects.filter(pk__in=[c.pk for c, _ in placed]).update(
            state=Cluster.State.RUNNING, state_reason="", state_reason_text=None,
            running_since=now, last_active_at=now, stopped_at=None, release_warned_at=None,
            no_gpu=False,
        )  # fmt: skip
        names = {h: cap.name for h, cap in fleet.hosts.items()}
        texts = {}
        for c, mine in placed:
            # Those that were stopped run again on the hosts that keep their workspaces, or
            # elsewhere with their saves (plan_elsewhere).
            if c.pk in kept_of:
                carry_saves(kept_of[c.pk], mine)
                moved = started_elsewhere(kept_of[c.pk], mine, names)
                if moved is not None:
                    texts[c.pk] = Text(
                        gettext_noop("placed: %(nodes)s; your files and system disk came along"),
                        nodes=moved,
                    )
        ClusterEvent.objects.bulk_create(
            [
                ClusterEvent(
                    cluster=c, at=now, kind="running", message=str(t)[:300], text=t.as_json()
                )
                for c, mine in placed
                for t in [texts.get(c.pk) or placed_text(mine, names)]
            ]
        )
        for cluster in Cluster.objects.filter(pk__in=[c.pk for c, _ in placed]):
            webhooks.cluster_changed(cluster, "running")  # in the placement's transaction
    for cluster, _ in placed:
        cluster.state = Cluster.State.RUNNING
        report.placed.append(cluster.pk)
        # Its network now, before any job: by dotted name (the runner sits above us).
        enqueue_by_name("jobs.tasks.cluster_network_ensure", cluster.pk, job_id=f"net-{cluster.pk}")
    waiting = Job.objects.filter(cluster_id__in=[c.pk for c, _ in placed], state__in=Job.WAITING)
    for cluster_id in set(waiting.values_list("cluster_id", flat=True)):
        lifecycle.request_dispatch(cluster_id)  # jobs submitted while the cluster was pending


def _lock_free_slots(host_ids: set[int]) -> dict[int, list[tuple[int, int]]]:
    """Free slots of active hosts, locked for this transaction (others skip them):
    host id -> [(slot id, GPU index)] in index order."""
    free: dict[int, list[tuple[int, int]]] = defaultdict(list)
    if not host_ids:
        return free
    rows = (
        GpuSlot.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(host_id__in=host_ids, node__isnull=True, host__state=Host.State.ACTIVE)
        .order_by("host_id", "index")
        .values_list("id", "host_id", "index")
    )
    for slot_id, host_id, index in rows:
        free[host_id].append((slot_id, index))
    return free


def _lock_cpu_capacity(host_ids: set[int]) -> dict[int, int]:
    """Free vCPUs of the given active hosts, with their rows locked against other schedulers."""
    caps = dict(
        Host.objects.select_for_update()
        .filter(id__in=host_ids, state=Host.State.ACTIVE)
        .order_by("id")  # one lock order for every scheduler: no deadlock
        .values_list("id", "cpu_count")
    )
    used = dict(
        Node.objects.filter(host_id__in=caps, released_at__isnull=True)
        .values_list("host_id")
        .annotate(n=Sum("vcpus"))
    )
    return {h: (cpus or 0) - (used.get(h) or 0) for h, cpus in caps.items()}


def _assign_slots(pairs: list[tuple[int, int]]) -> None:
    """slot id -> node id, in one statement a chunk. The caller holds the slots' row locks."""
    update_rows(GpuSlot, "id", ["node"], pairs)


def place_nodes(
    *, cluster: Cluster, hosts: list[int], first_index: int, now, prefer: list | None = None
) -> list[Node]:
    """Add nodes on `hosts` (one per entry) to a running cluster, holding their slots.
    `prefer`: per node, the GPU indices to take where all of them are free (a stopped
    cluster starting again gets its own GPUs back, so its workspaces are reused as they
    are). Runs inside the caller's transaction; raises Conflict, writing nothing, when the
    capacity is gone."""
    gpus = cluster.gpus_per_node
    vcpus = cluster.instance_type.vcpus if cluster.is_cpu_only else 0
    need: dict[int, int] = defaultdict(int)
    for host_id in hosts:
        need[host_id] += 1
    free = _lock_free_slots(set(need) if gpus else set())
    if gpus:
        short = [h for h, n in need.items() if len(free[h]) < n * gpus]
    else:
        cpu_free = _lock_cpu_capacity(set(need))
        short = [h for h, n in need.items() if cpu_free.get(h, 0) < n * vcpus]
    if short:
        raise Conflict(short[0])
    nodes, slots_of = [], []
    for offset, host_id in enumerate(hosts):
        if prefer and prefer[offset]:
            free[host_id] = _preferring(free[host_id], prefer[offset])
        taken, free[host_id] = free[host_id][:gpus], free[host_id][gpus:]
        nodes.append(
            Node(
                cluster=cluster,
                index=first_index + offset,
                host_id=host_id,
                gpu_indices=[i for _, i in taken],
                vcpus=vcpus,
                placed_at=now,
            )
        )
        slots_of.append([slot_id for slot_id, _ in taken])
    Node.objects.bulk_create(nodes)
    _assign_slots(
        [(slot, node.pk) for node, ids in zip(nodes, slots_of, strict=True) for slot in ids]
    )
    return nodes


def _preferring(free: list[tuple[int, int]], indices: list[int]) -> list[tuple[int, int]]:
    """Free (slot id, GPU index) pairs with `indices` first when all of them are free."""
    want = set(indices)
    if not want <= {i for _, i in free}:
        return free
    return [p for p in free if p[1] in want] + [p for p in free if p[1] not in want]


def describe_nodes(nodes: list[Node], names: dict[int, str] | None = None) -> str:
    return str(placed_text(nodes, names))[:300]


def nodes_text(nodes: list[Node], names: dict[int, str] | None = None) -> Text | str:
    """ "node 0 on host-a GPU 0-7, node 1 on host-b GPU 0-7", in the reader's language."""
    if names is None:
        names = dict(
            Host.objects.filter(id__in={n.host_id for n in nodes}).values_list("id", "name")
        )
    parts = []
    for node in nodes:
        where = names.get(node.host_id, f"host {node.host_id}")
        if node.gpu_indices:
            parts.append(
                Text(
                    gettext_noop("node %(index)s on %(host)s GPU %(gpus)s"),
                    index=node.index,
                    host=where,
                    gpus=format_indices(node.gpu_indices),
                )
            )
        else:
            parts.append(
                Text(gettext_noop("node %(index)s on %(host)s"), index=node.index, host=where)
            )
    return join(parts)


def placed_text(nodes: list[Node], names: dict[int, str] | None = None) -> Text:
    """ "placed: node 0 on host-a GPU 0-7, ..." (a cluster's running event)."""
    return Text(gettext_noop("placed: %(nodes)s"), nodes=nodes_text(nodes, names))


def format_indices(indices: list[int]) -> str:
    if not indices:
        return "—"
    if indices == list(range(indices[0], indices[-1] + 1)) and len(indices) > 2:
        return f"{indices[0]}-{indices[-1]}"
    return ",".join(str(i) for i in indices)


def replace_node(node: Node, *, host_id: int, now, same_slots: bool = False) -> Node | None:
    """Give a live node a new row: on `host_id` with fresh slots (a move: raises Conflict,
    writing nothing, when they are gone), or on its own host and GPUs (`same_slots`: its
    host is back). The old row ends at `now` and keeps its history (its replicas, where it
    ran); the new one is charged from `now`. Runs inside the caller's transaction."""
    node = Node.objects.select_for_update().filter(pk=node.pk, released_at__isnull=True).first()
    if node is None:
        return None  # moved or released meanwhile
    old_slots = list(
        GpuSlot.objects.select_for_update().filter(node=node).values_list("pk", flat=True)
    )
    Node.objects.filter(pk=node.pk).update(released_at=now)
    if same_slots:
        fresh = Node.objects.create(
            cluster_id=node.cluster_id, index=node.index, host_id=node.host_id,
            gpu_indices=node.gpu_indices, vcpus=node.vcpus, placed_at=now, no_gpu=node.no_gpu,
            preempted_at=now if node.preempted_at else None,  # a preempting cluster stays unbilled
        )  # fmt: skip
        GpuSlot.objects.filter(pk__in=old_slots).update(node=fresh)
        return fresh
    # A move: the old slots stay held by the old row until the engine of the host it leaves
    # confirms its containers are gone (lifecycle.free_nodes).
    cluster = Cluster.objects.select_related("instance_type").get(pk=node.cluster_id)
    return place_nodes(cluster=cluster, hosts=[host_id], first_index=node.index, now=now)[0]


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
        staying = list(
            Node.objects.filter(cluster_id=cluster_id, released_at__isnull=True)
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
        if hosts is None or not fleet.one_network(staying + hosts):
            why = (
                shortage(extra, fleet)
                if hosts is None
                else Text(
                    gettext_noop("the hosts with room cannot share a network with its other nodes")
                )
            )
            waiting = Text(
                gettext_noop("%(nodes)s: to be moved to another host; %(why)s"),
                nodes=where,
                why=why,
            )
            reason = str(waiting)[:300]
            with transaction.atomic():
                # Waiting for room is not charged (a down host's nodes are not already).
                Node.objects.filter(pk__in=[n.pk for n in nodes], lost_at__isnull=True).update(
                    lost_at=now
                )
                if (
                    Cluster.objects.filter(pk=cluster_id)
                    .exclude(state_reason=reason)
                    .update(state_reason=reason, state_reason_text=waiting.as_json())
                ):
                    ClusterEvent.objects.create(
                        cluster=cluster,
                        at=now,
                        kind="waiting",
                        message=reason,
                        text=waiting.as_json(),
                    )
            continue
        try:
            with transaction.atomic():
                locked = Cluster.objects.select_for_update().get(pk=cluster_id)
                if (
                    locked.state != Cluster.State.RUNNING
                    or locked.jobs.filter(state__in=Job.ACTIVE).exists()
                ):
                    continue
                fresh = [
                    n
                    for n in nodes
                    if Node.objects.filter(pk=n.pk, released_at__isnull=True).exists()
                ]
                pairs = [
                    (node, replace_node(node, host_id=host_id, now=now))
                    for node, host_id in zip(fresh, hosts, strict=False)
                ]
                pairs = [(old, new) for old, new in pairs if new is not None]
                if not pairs:
                    continue
                fresh, placed = [p[0] for p in pairs], [p[1] for p in pairs]
                names = {h: cap.name for h, cap in fleet.hosts.items()}
                moves = [_moved(old, new, names) for old, new in zip(fresh, placed, strict=True)]
                message = moves[-1]
                for move in reversed(moves[:-1]):
                    message = Text(gettext_noop("%(first)s; %(rest)s"), first=move, rest=message)
                Cluster.objects.filter(pk=cluster_id).update(
                    state_reason="", state_reason_text=None, last_active_at=now
                )
                ClusterEvent.objects.create(
                    cluster=cluster,
                    at=now,
                    kind="moved",
                    message=str(message)[:300],
                    text=message.as_json(),
                )
                lifecycle.request_dispatch(cluster_id)
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


# A host's state inside a sentence of the timeline.
HOST_STATES = {
    "active": gettext_noop("active"),
    "draining": gettext_noop("draining"),
    "degraded": gettext_noop("degraded"),
    "down": gettext_noop("down"),
}


def host_state(state: str) -> Text:
    return Text(HOST_STATES.get(state, state))


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


def _say(cluster: Cluster, reason: Text, *, always: bool = False) -> bool:
    """Set the (unsaved) cluster's state reason and its twin; False when it said that
    already (unless `always`)."""
    said = str(reason)[:300]
    if cluster.state_reason == said and not always:
        return False
    cluster.state_reason, cluster.state_reason_text = said, reason.as_json()
    return True


def place_pending(*, fleet: Fleet | None = None) -> PassReport:
    """One pass over the queue. Safe to run twice, and by several workers at once."""
    fleet = fleet or Fleet.load()
    report = PassReport()
    # Running clusters stranded on a failed host go first: they were placed before anything
    # in the queue, and their researchers are waiting on them now.
    report.moved = move_stranded(fleet, report)
    heads: dict[str, Cluster] = {}
    on_demand_heads: dict[str, Cluster] = {}  # the first on-demand request that did not fit
    reasons: list[Cluster] = []
    pending = (
        Cluster.objects.filter(state=Cluster.State.PENDING)
        .select_related("gpu_model", "instance_type")
        .order_by("spot", "queued_at", "id")
    )
    batch: list[tuple[Cluster, list[int]]] = []
    for cluster in pending.iterator(chunk_size=2000):
        key = resource_key(cluster)
        if cluster.stopped_at is not None:
            # A stopped cluster waiting to start again: only on the hosts that keep its
            # workspaces. Those hosts are held for it while it waits (not the whole pool).
            hosts, why = plan_kept(cluster, fleet)
            if hosts is None:
                report.waiting += 1
                if why and _say(cluster, why):
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
            batch.append((cluster, hosts))
            if len(batch) >= BATCH:
                _commit_batch(batch, fleet, report)
                batch = []
            continue
        report.waiting += 1
        if not cluster.spot and key not in on_demand_heads:
            on_demand_heads[key] = cluster
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
        if _say(cluster, reason):
            reasons.append(cluster)
    if batch:
        _commit_batch(batch, fleet, report)
    if on_demand_heads:
        notes = reclaim_spot(list(on_demand_heads.values()), fleet, report)
        listed = {c.pk for c in reasons}
        for cluster in on_demand_heads.values():
            if cluster.pk in notes:
                _say(cluster, notes[cluster.pk], always=True)
                if cluster.pk not in listed:
                    reasons.append(cluster)
    if reasons:
        # Only rows still pending: a cluster placed or released meanwhile keeps its state.
        for cluster in reasons:
            Cluster.objects.filter(pk=cluster.pk, state=Cluster.State.PENDING).update(
                state_reason=cluster.state_reason, state_reason_text=cluster.state_reason_text
            )
    if report.placed:
        log.info("placed %d cluster(s), %d waiting", len(report.placed), report.waiting)
    return report


# -- reclaiming spot capacity for on-demand requests ---------------------------------------------


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
    now and give back soon, per host."""
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
