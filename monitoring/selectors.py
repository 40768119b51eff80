"""Reads of stored samples: chart series, the diagnosis, and the fleet's picture."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from jobs.models import Cluster, Host, Job, Node
from monitoring.diagnosis import Finding, Point, diagnose
from monitoring.models import Rollup, Sample

FIELDS = (
    "at", "node_index", "gpu_util", "gpu_mem_mib", "cpu_pct", "mem_bytes", "net_rx_bps",
    "net_tx_bps", "disk_read_bps", "disk_write_bps", "read_iops", "write_iops",
)  # fmt: skip
MAX_POINTS = 20_000


def _rows(model, **filters):
    return list(
        model.objects.filter(**filters).order_by("at", "node_index").values(*FIELDS)[:MAX_POINTS]
    )


def job_rows(job: Job) -> tuple[str, list[dict]]:
    """A job's samples: ("second", rows) while raw samples exist, else ("minute", rollups)."""
    rows = _rows(Sample, job=job)
    if rows:
        return "second", rows
    return "minute", _rows(Rollup, job=job)


def as_series(rows: list[dict]) -> list[dict]:
    """Rows as the charts' JSON: epoch seconds and plain numbers."""
    return [
        {
            "t": int(r["at"].timestamp()), "node": r["node_index"], "gpu": r["gpu_util"],
            "gmem": r["gpu_mem_mib"], "cpu_pct": round(r["cpu_pct"], 1),
            "mem_bytes": r["mem_bytes"], "net_rx_bps": round(r["net_rx_bps"]),
            "net_tx_bps": round(r["net_tx_bps"]), "disk_read_bps": round(r["disk_read_bps"]),
            "disk_write_bps": round(r["disk_write_bps"]), "read_iops": round(r["read_iops"], 1),
            "write_iops": round(r["write_iops"], 1),
        }
        for r in rows
    ]  # fmt: skip


def cluster_recent(cluster: Cluster, seconds: int = 600) -> list[dict]:
    """The last ten minutes of a cluster's samples: what a live chart starts from."""
    since = timezone.now() - timedelta(seconds=seconds)
    return as_series(_rows(Sample, cluster=cluster, at__gte=since))


def cores_per_node(cluster: Cluster) -> int:
    """The CPU cores a node of this cluster gets: its share of its host's cores."""
    node = Node.objects.filter(cluster=cluster).select_related("host").order_by("index").first()
    host = node.host if node else None
    if host is None or not host.cpu_count:
        return 8
    if cluster.instance_type_id:
        return (
            cluster.instance_type.vcpus
            if hasattr(cluster.instance_type, "vcpus")
            else host.cpu_count
        )
    if not host.gpu_count:
        return host.cpu_count
    return max(1, host.cpu_count * cluster.gpus_per_node // host.gpu_count)


def diagnosis(job: Job, rows: list[dict] | None = None) -> list[Finding]:
    """What slowed the job down, from its samples (`rows` when the caller has read them)."""
    if rows is None:
        _, rows = job_rows(job)
    points = [
        Point(
            at=r["at"], node=r["node_index"], gpu_util=tuple(r["gpu_util"] or ()),
            cpu_pct=r["cpu_pct"], net_rx_bps=r["net_rx_bps"], net_tx_bps=r["net_tx_bps"],
            read_iops=r["read_iops"], write_iops=r["write_iops"],
            disk_read_bps=r["disk_read_bps"], disk_write_bps=r["disk_write_bps"],
        )
        for r in rows
    ]  # fmt: skip
    return diagnose(points, cpu_cores=cores_per_node(job.cluster))


def fleet(window_s: int = 5) -> dict:
    """Every active host's GPUs (latest utilisation per slot, None where not rented), the
    hosts' network and disk rates, and how many rented GPUs sit idle (< 10 % for the last
    minute)."""
    now = timezone.now()
    hosts = list(Host.objects.exclude(state=Host.State.DOWN).order_by("name"))
    recent = Sample.objects.filter(at__gte=now - timedelta(seconds=window_s))
    latest_at = dict(
        recent.values("host_id", "cluster_id", "node_index")
        .annotate(last=Max("at"))
        .values_list("cluster_id", "last")
    )
    nodes = {
        (n.cluster_id, n.index): n
        for n in Node.objects.filter(released_at__isnull=True, host__in=hosts)
    }
    grid = {h.pk: [None] * h.gpu_count for h in hosts}
    rates = {h.pk: {"net_bps": 0.0, "disk_bps": 0.0, "iops": 0.0} for h in hosts}
    seen = set()
    for s in recent.order_by("-at").values(
        "host_id", "cluster_id", "node_index", "gpu_util", "net_rx_bps", "net_tx_bps",
        "disk_read_bps", "disk_write_bps", "read_iops", "write_iops", "at",
    ):  # fmt: skip
        key = (s["cluster_id"], s["node_index"])
        if key in seen or s["at"] != latest_at.get(s["cluster_id"], s["at"]):
            continue
        seen.add(key)
        node = nodes.get(key)
        if node is not None and s["host_id"] in grid:
            for index, util in zip(node.gpu_indices, s["gpu_util"] or [], strict=False):
                if index < len(grid[s["host_id"]]):
                    grid[s["host_id"]][index] = util
        if s["host_id"] in rates:
            r = rates[s["host_id"]]
            r["net_bps"] += s["net_rx_bps"] + s["net_tx_bps"]
            r["disk_bps"] += s["disk_read_bps"] + s["disk_write_bps"]
            r["iops"] += s["read_iops"] + s["write_iops"]
    minute = Sample.objects.filter(at__gte=now - timedelta(seconds=60)).values_list(
        "cluster_id", "node_index", "gpu_util"
    )
    busiest: dict[tuple[int, int], list[float]] = {}
    for cluster_id, node_index, utils in minute:
        best = busiest.setdefault((cluster_id, node_index), [0.0] * len(utils or []))
        for i, u in enumerate(utils or []):
            if i < len(best):
                best[i] = max(best[i], u)
    rented = sum(len(n.gpu_indices) for n in nodes.values())
    idle = sum(
        len(n.gpu_indices) if key not in busiest else sum(1 for u in busiest[key] if u < 10)
        for key, n in nodes.items()
    )
    return {
        "hosts": [
            {
                "id": h.pk,
                "name": h.name,
                "gpus": grid[h.pk],
                "emulated": h.emulated_gpu,
                **rates[h.pk],
            }
            for h in hosts
        ],
        "rented_gpus": rented,
        "idle_rented_gpus": idle,
        "at": int(now.timestamp()),
        "raw_hours": settings.SUANLI_METRICS_RAW_HOURS,
    }
