"""The idle rule's reading of the samples (scheduled and idle shutdown: jobs/clusters/
shutdown.py), and the cron entry that applies the shutdown rules with it.

A window of N whole minutes is idle when, for each node of the cluster and each minute of
it, the monitor left samples of every GPU of the node and none reached the threshold. A
finished minute is read from its rollup (the mean of its seconds, monitoring/tasks.py), a
minute not rolled up yet from its raw samples (each second's value). A minute of a node
with no sample (the monitor down, the node just placed) is not idle: without samples,
nothing is stopped.

Layer: monitoring, above jobs: reads its own tables, calls jobs.clusters.shutdown.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from jobs.clusters import shutdown
from jobs.models import Cluster
from monitoring.models import Rollup, Sample

MINUTE = timedelta(minutes=1)


def _minute(when: datetime) -> datetime:
    return when.replace(second=0, microsecond=0)


def gpus_idle(
    cluster: Cluster, nodes: list[int], start: datetime, end: datetime, below: int
) -> bool:
    """Whether every GPU of `nodes` stayed under `below` percent in every minute of
    [start, end), with samples covering each (node, minute). Reads the newest first and
    stops at the first busy value, so a working cluster costs a few rows a tick; an idle
    one reads its window (8 nodes x 8 GPUs over 1440 minutes of rollups: about 0.1 s)."""
    width = max(1, cluster.gpus_per_node)
    wanted = {(n, start + k * MINUTE) for n in nodes for k in range((end - start) // MINUTE)}
    seen: set[tuple[int, datetime]] = set()

    def read(rows) -> bool:  # False at the first busy value
        for index, at, util in rows:
            key = (index, _minute(at))
            if key not in wanted:
                continue
            values = util if isinstance(util, list) else []
            if len(values) < width:
                continue  # not every GPU measured: covers nothing
            if any(v is None or float(v) >= below for v in values):
                return False
            seen.add(key)
        return True

    # Newest first: a busy cluster is known from its last minutes.
    rollups = (
        Rollup.objects.filter(
            cluster_id=cluster.pk, node_index__in=nodes, at__gte=start, at__lt=end
        )
        .order_by("-at")
        .values_list("node_index", "at", "gpu_util")
    )
    if not read(rollups.iterator(chunk_size=2000)):
        return False
    missing = wanted - seen
    if not missing:
        return True
    raw = (
        Sample.objects.filter(
            cluster_id=cluster.pk,
            node_index__in=nodes,
            at__gte=min(at for _, at in missing),
            at__lt=end,
        )
        .order_by("-at")
        .values_list("node_index", "at", "gpu_util")
    )
    if not read(raw.iterator(chunk_size=2000)):
        return False
    return not (wanted - seen)


def clusters_shutdown() -> dict[str, list[int]]:
    """Cron, every minute: the clusters' scheduled and idle stops."""
    return shutdown.tick(idle=gpus_idle)
