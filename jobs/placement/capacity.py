"""The free capacity of the active hosts, in memory, for one pass (`Fleet`), and the
plan of one cluster on it: gang, best fit, one zone first, RDMA never spread, one network
(members of one Docker swarm, or one host), a fair head of line per resource
(`Fleet.reserve_for`). Also why a cluster does not fit now (`shortage`) and a host's state
in a sentence. Reads the database once per pass (`Fleet.load`); writes nothing.

Layer: placement, the bottom of it (slots, restart, stranded, reclaim and scheduler plan with
it); uses models and base (text).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from django.db.models import Count, Sum
from django.utils.translation import gettext_noop

from jobs.base import validators
from jobs.base.text import Text
from jobs.models import MAX_GPUS_PER_HOST, Cluster, GpuSlot, Host, Node


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
    images: frozenset = frozenset()  # the catalog images (references) its check recorded


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
    # The host's size last: `room` counts whole pools of hosts large enough for a node.
    return (cap.gpu_model_id, cap.zone, cap.rdma, cap.swarm, cap.gpu_total)


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
        # image reference -> the hosts whose check recorded it (`only_on`: a look-up, not a
        # walk over the fleet per request)
        self.with_image: dict[str, set[int]] = defaultdict(set)
        # the hosts an ended node's GPUs are being freed on (few; fixed for the pass)
        self.freeing = [cap for cap in hosts if cap.freeing]
        # GPU hosts out of the buckets for another resource's hold (a stopped CPU-only
        # cluster's kept hosts): `room` counts them back for a GPU request
        self.held_for_other: set[int] = set()
        self._usable: dict[tuple, list[HostCap]] = {}  # `usable_hosts`, per kind of request
        for cap in hosts:
            if cap.gpu_model_id is not None:
                self.buckets[_pool_key(cap)][cap.free].add(cap.id)
            for ref in cap.images:
                self.with_image[ref].add(cap.id)

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
            "swarm_state", "swarm_cluster", "images",
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
                    images=frozenset(str(ref) for ref in images or ()),
                )
                for i, name, zone, rdma, model, gpus, cpus, state, swarm, images in rows
            ]
        )

    def gpus(self) -> int:
        """The GPUs of the active hosts, free or not: what fair share measures usage against."""
        return sum(cap.gpu_total or 0 for cap in self.hosts.values() if cap.gpu_model_id)

    # -- what a cluster may use ------------------------------------------------------
    def pools_for(self, cluster: Cluster) -> dict[str, list[tuple]]:
        """Matching GPU pools, grouped by zone."""
        zones: dict[str, list[tuple]] = defaultdict(list)
        for key in self.buckets:
            model, zone, rdma, _, _ = key
            if model != cluster.gpu_model_id:
                continue
            if cluster.zone and zone != cluster.zone:
                continue
            if cluster.network == Cluster.Network.RDMA and not rdma:
                continue
            zones[zone].append(key)
        return zones

    def only_on(self, cluster: Cluster) -> str | None:
        """`only_on_hosts(cluster)` when some host of the fleet records that image: placement
        then keeps to the hosts that have it. When none records it (hosts not checked since
        images were recorded), None: it is placed as before, and a host without it fails the
        start in words, charging nothing (the form already refuses an image no host has)."""
        only = only_on_hosts(cluster)
        if only is None or not self.with_image.get(only):
            return None
        return only

    def usable_hosts(self, cluster: Cluster, *, image: bool = True) -> list[HostCap]:
        """Every active host that could ever hold a node of this cluster: of its zone, GPU
        model, network and size, and having its image when that is never pulled
        (`only_on_hosts`; `image=False`: whether it has it or not). Worked out once per
        kind of request in a pass (the hosts do not change; their free counts are live):
        not a walk over the fleet for each request that waits (callers only read it)."""
        only = self.only_on(cluster) if image else None
        cpu = cluster.instance_type.vcpus if cluster.is_cpu_only else 0
        rdma = cluster.network == Cluster.Network.RDMA
        kind = (cluster.zone, only, cpu, cluster.gpu_model_id, cluster.gpus_per_node, rdma)
        out = self._usable.get(kind)
        if out is None:
            out = self._usable[kind] = [
                cap for cap in self.hosts.values() if _usable(cap, cluster, only, rdma)
            ]
        return out

    # -- planning ---------------------------------------------------------------------
    def _fit_gpu(
        self, pools: list[tuple], nodes: int, gpus: int, allowed: set[int] | None = None
    ) -> list[int] | None:
        """`allowed`: only these hosts (those having a cluster's image that is never
        pulled); None: any."""
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
                    host_id = next(
                        (
                            h
                            for h in buckets[free]
                            if h not in overlay and (allowed is None or h in allowed)
                        ),
                        None,
                    )
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

    def _fit_gpu_networked(
        self, pools: list[tuple], nodes: int, gpus: int, allowed: set[int] | None = None
    ) -> list[int] | None:
        """`_fit_gpu` that keeps a multi-node cluster on one network: across members of one
        swarm, or all on one host outside a swarm. The tightest fit of those wins."""
        if nodes == 1:
            return self._fit_gpu(pools, 1, gpus, allowed)
        best: tuple[int, list[int]] | None = None
        for swarm, keys in _by_swarm(pools, lambda key: key[3]).items():
            if swarm:
                chosen = self._fit_gpu(keys, nodes, gpus, allowed)
            else:
                one = self._fit_gpu(keys, 1, nodes * gpus, allowed)
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
        # The pools hold only hosts of its model, zone and network, and a host with `gpus`
        # free is large enough: of the usable hosts, what is left to check is the image.
        only = self.only_on(cluster)
        allowed = self.with_image[only] if only else None
        best: tuple[int, list[int]] | None = None
        for pools in zones.values():
            chosen = self._fit_gpu_networked(pools, cluster.nodes, cluster.gpus_per_node, allowed)
            if chosen is not None:
                leftover = sum(self.hosts[h].free for h in set(chosen)) - cluster.total_gpus
                if best is None or leftover < best[0]:
                    best = (leftover, chosen)
        if best is not None:
            return best[1]
        if not cluster.zone and cluster.network == Cluster.Network.STANDARD and len(zones) > 1:
            return self._fit_gpu_networked(
                [k for pools in zones.values() for k in pools],
                cluster.nodes,
                cluster.gpus_per_node,
                allowed,
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
                if key != f"gpu:{cap.gpu_model_id}":
                    self.held_for_other.add(host_id)

    def reserve_for(self, cluster: Cluster) -> None:
        hosts = self.usable_hosts(cluster)
        self.reserved[resource_key(cluster)].update(h.id for h in hosts)
        if not cluster.is_cpu_only:
            for cap in hosts:
                self.buckets[_pool_key(cap)][cap.free].discard(cap.id)

    def room(self, cluster: Cluster) -> tuple[int, int]:
        """(nodes that would fit now one by one, GPUs or vCPUs free) on usable, unreserved hosts."""
        reserved = self.reserved[resource_key(cluster)]
        if not cluster.is_cpu_only and self.only_on(cluster) is None:
            return self._gpu_room(cluster, reserved)
        hosts = [h for h in self.usable_hosts(cluster) if h.id not in reserved]
        if cluster.is_cpu_only:
            need = cluster.instance_type.vcpus
            return sum(max(h.cpu_free, 0) // need for h in hosts), sum(
                max(h.cpu_free, 0) for h in hosts
            )
        return sum(h.free // cluster.gpus_per_node for h in hosts), sum(h.free for h in hosts)

    def _gpu_room(self, cluster: Cluster, reserved: set[int]) -> tuple[int, int]:
        """`room` of a GPU request from the buckets: they hold every host of its model that
        is not reserved for it (nor held for another of its model), by pool and free count,
        so this counts whole buckets (pools of hosts large enough for a node, in its zone
        and network), whatever the fleet's size."""
        gpus = cluster.gpus_per_node
        fit = free = 0
        for pools in self.pools_for(cluster).values():
            for key in pools:
                if key[4] < gpus:
                    continue
                for count, ids in enumerate(self.buckets[key]):
                    fit += count // gpus * len(ids)
                    free += count * len(ids)
        for host_id in self.held_for_other - reserved:  # usually none
            cap = self.hosts[host_id]
            if host_id not in self.buckets[_pool_key(cap)][cap.free] and _usable(
                cap, cluster, None, cluster.network == Cluster.Network.RDMA
            ):
                fit += cap.free // gpus
                free += cap.free
        return fit, free


def _usable(cap: HostCap, cluster: Cluster, only: str | None, rdma: bool) -> bool:
    """Whether the host could ever hold a node of the cluster (`Fleet.usable_hosts`)."""
    if cluster.zone and cap.zone != cluster.zone:
        return False
    if only is not None and only not in cap.images:
        return False
    if cluster.is_cpu_only:
        return cap.cpu_total >= cluster.instance_type.vcpus
    if cap.gpu_model_id != cluster.gpu_model_id or cap.gpu_total < cluster.gpus_per_node:
        return False
    return not rdma or cap.rdma


def only_on_hosts(cluster: Cluster) -> str | None:
    """The reference of the cluster's catalog image when hosts never pull it
    (`Image.pullable` off, not one of Suanli's registry): it runs only on the hosts whose
    check recorded it (`Host.images`); None for any other image."""
    if getattr(cluster, "image_id", None) is None:
        return None
    image = cluster.image
    if image.pullable or validators.names_registry(image.reference):
        return None
    return image.reference


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
    only = fleet.only_on(cluster)
    rdma = cluster.network == Cluster.Network.RDMA
    freeing = (
        [] if cluster.is_cpu_only else [h for h in fleet.freeing if _usable(h, cluster, only, rdma)]
    )
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
    only = fleet.only_on(cluster)
    if only and not fleet.usable_hosts(cluster) and fleet.usable_hosts(cluster, image=False):
        return Text(
            gettext_noop(
                "no active host %(where)s that is large enough for a node of %(shape)s has "
                "the image %(image)s, which hosts never pull (an operator puts it on hosts): "
                "pick another image, or ask for it on a host"
            ),
            where=where,
            shape=cluster.shape,
            image=only,
        )
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


# A host's state inside a sentence of the timeline.
HOST_STATES = {
    "active": gettext_noop("active"),
    "draining": gettext_noop("draining"),
    "degraded": gettext_noop("degraded"),
    "down": gettext_noop("down"),
}


def host_state(state: str) -> Text:
    return Text(HOST_STATES.get(state, state))
