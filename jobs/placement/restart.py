"""Stopped clusters starting again: on the hosts that keep their workspaces
(`plan_kept`), or elsewhere when those have no room and every node's system disk is saved
(`plan_elsewhere`), carrying the saves to the nodes that moved (`carry_saves`).

Layer: placement, over slots; uses slots, capacity, models and base (text).
"""

from __future__ import annotations

from collections import defaultdict

from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Text, join
from jobs.models import Cluster, Host, Node
from jobs.placement.capacity import Fleet, host_state, resource_key
from jobs.placement.slots import format_indices, nodes_text


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
