"""Nodes written with their GPU slots (and vCPUs) locked: a running cluster's new nodes
(`place_nodes`), a live node given a new row on another or its own host (`replace_node`),
the slot locks a pass takes before it writes, and the sentences that say where nodes are.

Layer: placement, over capacity; uses capacity, models and base (sql, text).
"""

from __future__ import annotations

from collections import defaultdict

from django.db.models import Sum
from django.utils.translation import gettext_noop

from jobs.base.sql import update_rows
from jobs.base.text import Text, join
from jobs.models import Cluster, GpuSlot, Host, Node
from jobs.placement.capacity import Conflict


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
    free = lock_free_slots(set(need) if gpus else set())
    if gpus:
        short = [h for h, n in need.items() if len(free[h]) < n * gpus]
    else:
        cpu_free = lock_cpu_capacity(set(need))
        short = [h for h, n in need.items() if cpu_free.get(h, 0) < n * vcpus]
    if short:
        raise Conflict(short[0])
    nodes, slots_of = [], []
    for offset, host_id in enumerate(hosts):
        if prefer and prefer[offset]:
            free[host_id] = preferring(free[host_id], prefer[offset])
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
    assign_slots(
        [(slot, node.pk) for node, ids in zip(nodes, slots_of, strict=True) for slot in ids]
    )
    return nodes


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


def lock_free_slots(host_ids: set[int]) -> dict[int, list[tuple[int, int]]]:
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


def lock_cpu_capacity(host_ids: set[int]) -> dict[int, int]:
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


def assign_slots(pairs: list[tuple[int, int]]) -> None:
    """slot id -> node id, in one statement a chunk. The caller holds the slots' row locks."""
    update_rows(GpuSlot, "id", ["node"], pairs)


def preferring(free: list[tuple[int, int]], indices: list[int]) -> list[tuple[int, int]]:
    """Free (slot id, GPU index) pairs with `indices` first when all of them are free."""
    want = set(indices)
    if not want <= {i for _, i in free}:
        return free
    return [p for p in free if p[1] in want] + [p for p in free if p[1] not in want]


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
