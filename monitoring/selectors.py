"""Reads of stored samples: chart series, the diagnosis, and the fleet's picture.

A chart gets at most MAX_CHART_POINTS points a series: longer runs are decimated (min-max
per time bucket, in PostgreSQL by `buckets.min_max`, elsewhere by `decimate`) so that a
page stays small and quick while a dip of one second stays visible. The diagnosis reads
every second (summed over the nodes in PostgreSQL by `buckets.per_second`)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import caches
from django.db import connection
from django.db.models import Count, Max, Min, QuerySet
from django.utils import timezone
from django.utils.translation import get_language

from jobs.models import Cluster, GpuSlot, Host, Job, Node, Replica
from monitoring import buckets
from monitoring.diagnosis import Finding, Point, diagnose, diagnose_seconds
from monitoring.models import Rollup, Sample

FIELDS = (
    "at", "job_id", "node_index", "gpu_util", "gpu_mem_mib", "cpu_pct", "mem_bytes",
    "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps", "read_iops", "write_iops",
)  # fmt: skip
MAX_POINTS = 20_000  # raw seconds read for a chart; more: the minute rollups instead
MAX_CHART_POINTS = 2_000  # a series' points on a chart: about what its width can show


def _rows(model, limit: int = MAX_POINTS, **filters):
    return _values(model.objects.filter(**filters), limit)


def _values(queryset: QuerySet, limit: int | None = MAX_POINTS) -> list[dict]:
    return list(queryset.order_by("at", "node_index").values(*FIELDS)[:limit])


def job_span(job: Job) -> tuple[datetime, datetime] | None:
    """The job's own time range: its first replica's start (over every attempt) to its end
    (now while it runs), in whole seconds as samples are stamped. None before it started."""
    span = Replica.objects.filter(job=job).aggregate(
        start=Min("started_at"), end=Max("finished_at")
    )
    start = span["start"] or job.started_at
    if start is None:
        return None
    end = (job.finished_at or span["end"]) if job.is_ended else None
    return start.replace(microsecond=0), end or timezone.now()


def _job_source(
    job: Job, *, since: datetime | None = None, until: datetime | None = None, live=False
) -> tuple[str, QuerySet]:
    """Where a job's own samples are: its replicas' samples within its own time range (from
    `since`, to `until` when given). ("second", samples) while raw samples exist, else
    ("minute", rollups); rollups too when the raw seconds would exceed MAX_POINTS (never
    for a `live` chart: it reads only seconds)."""
    span = job_span(job)
    if span is None:
        return "second", Sample.objects.none()
    start, end = span
    if since is not None:
        start = max(start, since)
    if until is not None:
        end = min(end, until)
    seconds = Sample.objects.filter(job=job, at__gte=start, at__lte=end)
    if live:
        return "second", seconds
    count = seconds.count()
    if count and count <= MAX_POINTS:
        return "second", seconds
    # A rollup holds a minute of its cluster (tagged with the minute's last job): the
    # cluster runs one job at a time, so the minutes of the job's range are the job's.
    minutes = Rollup.objects.filter(
        cluster_id=job.cluster_id, at__gte=start.replace(second=0), at__lte=end
    )
    if minutes.exists():
        return "minute", minutes
    return "second", seconds


def job_rows(
    job: Job, *, since: datetime | None = None, until: datetime | None = None
) -> tuple[str, list[dict]]:
    """A job's own samples (see `_job_source`; `since` alone: a live chart's start), at
    most MAX_POINTS raw seconds."""
    live = since is not None and until is None
    resolution, samples = _job_source(job, since=since, until=until, live=live)
    return resolution, _values(samples, MAX_POINTS if resolution == "second" else None)


def _kept(kind: str, job: Job, compute):
    """A finished job's whole chart or diagnosis, computed once per process and kept in the
    `charts` cache (settings.CACHES) under what it is computed from: the job's attempt and
    end, and its samples' count and last second (one index-only aggregate). A sample
    stored late, or pruned, is another key: the page never shows a stale picture."""
    if not job.is_ended:
        return compute()
    key = f"{kind}:{_samples_key(job)}"
    cache = caches["charts"]
    value = cache.get(key)
    if value is None:
        value = compute()
        cache.set(key, value)
    return value


def _samples_key(job: Job) -> str:
    """What a finished job's picture is computed from, read once per job object (a page
    asks for its chart and its diagnosis)."""
    key = getattr(job, "_samples_key", None)
    if key is None:
        seen = Sample.objects.filter(job=job).aggregate(n=Count("id"), last=Max("at"))
        ended = job.finished_at.timestamp() if job.finished_at else None
        last = seen["last"].timestamp() if seen["last"] else None
        key = job._samples_key = f"{job.pk}:{job.attempt}:{ended}:{seen['n']}:{last}"
    return key


def job_chart(
    job: Job, *, since: datetime | None = None, until: datetime | None = None
) -> tuple[str, list[dict], int]:
    """A finished job's samples (from `since` to `until` when given: a zoomed chart) as
    its charts show them: (resolution, rows, step). A node with more than
    MAX_CHART_POINTS rows is decimated to that many: `step` is then the seconds each
    bucket stands for (see `decimate`), else 0. The whole chart is kept (`_kept`)."""
    if since is None and until is None:
        return _kept("chart", job, lambda: _job_chart(job))
    return _job_chart(job, since=since, until=until)


def _job_chart(
    job: Job, *, since: datetime | None = None, until: datetime | None = None
) -> tuple[str, list[dict], int]:
    resolution, samples = _job_source(job, since=since, until=until)
    if connection.vendor == "postgresql":
        nodes, gpus = buckets.survey(samples)
    else:
        nodes, gpus = _nodes(samples), None
    if not nodes:
        return resolution, [], 0
    if max(node["n"] for node in nodes) <= MAX_CHART_POINTS:
        return resolution, _values(samples, None), 0
    if connection.vendor != "postgresql":
        return resolution, *decimate(_values(samples, MAX_POINTS))
    first = min(node["first"] for node in nodes)
    width = _bucket_s(first, max(node["last"] for node in nodes), MAX_CHART_POINTS)
    return resolution, buckets.min_max(samples, first=first, width=width, gpus=gpus), width


def _nodes(samples: QuerySet) -> list[dict]:
    return list(
        samples.order_by()
        .values("node_index")
        .annotate(n=Count("id"), first=Min("at"), last=Max("at"))
    )


def _bucket_s(first: datetime, last: datetime, max_points: int) -> int:
    """Whole seconds a bucket spans, so that first..last makes at most max_points / 2."""
    span_s = (last - first).total_seconds() + 1
    return max(1, math.ceil(span_s / max(1, max_points // 2)))


def decimate(rows: list[dict], max_points: int = MAX_CHART_POINTS) -> tuple[list[dict], int]:
    """Rows (in time order) thinned for a chart: at most `max_points` points per node and
    series, and the width in seconds of the buckets they stand for (0: every row kept).

    Min-max decimation: the rows' time range is cut into max_points / 2 equal buckets; a
    node's bucket becomes two rows, at its first and its last sample's time, which hold
    each series' minimum and maximum in the order they occurred (a GPU list, per GPU).
    So a one-second dip to 3 % among 90 % stays on the chart. A bucket's values stay
    real readings; only their time moves within the bucket, under a pixel on a chart."""
    per_node: dict[int, list[dict]] = {}
    for r in rows:
        per_node.setdefault(r["node_index"], []).append(r)
    if all(len(node_rows) <= max_points for node_rows in per_node.values()):
        return rows, 0
    first = rows[0]["at"]
    width = _bucket_s(first, rows[-1]["at"], max_points)
    out: list[dict] = []
    for node_rows in per_node.values():
        bucket: list[dict] = []
        current = None
        for r in node_rows:
            index = int((r["at"] - first).total_seconds()) // width
            if index != current and bucket:
                out += _min_max(bucket)
                bucket = []
            current = index
            bucket.append(r)
        if bucket:
            out += _min_max(bucket)
    out.sort(key=lambda r: (r["at"], r["node_index"]))
    return out, width


def _min_max(bucket: list[dict]) -> list[dict]:
    """One bucket of one node's rows as at most two: see `decimate`."""
    if len(bucket) <= 2:
        return bucket
    early, late = dict(bucket[0]), dict(bucket[-1])

    def pick(values: list) -> tuple:
        low, high = min(values), max(values)
        return (low, high) if values.index(low) <= values.index(high) else (high, low)

    for key in buckets.SCALARS:
        early[key], late[key] = pick([r[key] for r in bucket])
    for key in buckets.PER_GPU:
        lists = [r[key] or [] for r in bucket]
        gpus = max(len(values) for values in lists)
        early[key], late[key] = [None] * gpus, [None] * gpus
        for gpu in range(gpus):
            picked = pick([values[gpu] for values in lists if len(values) > gpu])
            early[key][gpu], late[key][gpu] = picked
    return [early, late]


def as_series(rows: list[dict]) -> list[dict]:
    """Rows as the charts' JSON: epoch seconds, the time in the reader's zone with its
    offset (`at`: what the axes show; the zone active for the request), plain numbers."""
    zone = timezone.get_current_timezone()
    return [
        {
            "t": int(r["at"].timestamp()), "at": r["at"].astimezone(zone).isoformat(),
            "job": r["job_id"], "node": r["node_index"],
            "gpu": r["gpu_util"], "gmem": r["gpu_mem_mib"], "cpu_pct": round(r["cpu_pct"], 1),
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
    """What slowed the job down, from its samples (`rows` when the caller has read them),
    every second of them: the chart's decimated rows would hide a dip's length. Kept for
    a finished job (`_kept`)."""
    if rows is None:
        # Findings are sentences in the language active when they were made: one kept
        # diagnosis per language.
        return _kept(
            f"diagnosis:{get_language()}:{timezone.get_current_timezone_name()}",
            job,
            lambda: _diagnosis(job),
        )
    return _diagnosis(job, rows)


def _diagnosis(job: Job, rows: list[dict] | None = None) -> list[Finding]:
    cores = cores_per_node(job.cluster)
    if rows is None:
        _, samples = _job_source(job)
        if connection.vendor == "postgresql":
            return diagnose_seconds(buckets.per_second(samples), cpu_cores=cores)
        rows = _values(samples, MAX_POINTS)
    points = [
        Point(
            at=r["at"], node=r["node_index"], gpu_util=tuple(r["gpu_util"] or ()),
            cpu_pct=r["cpu_pct"], net_rx_bps=r["net_rx_bps"], net_tx_bps=r["net_tx_bps"],
            read_iops=r["read_iops"], write_iops=r["write_iops"],
            disk_read_bps=r["disk_read_bps"], disk_write_bps=r["disk_write_bps"],
        )
        for r in rows
    ]  # fmt: skip
    return diagnose(points, cpu_cores=cores)


def fleet(window_s: int = 5) -> dict:
    """Every up host's GPUs, one entry per GPU slot: free or held (and by which cluster),
    with the latest second's utilisation where a sample has one (an emulated-GPU host has
    readings only while a replica runs: they are derived from its CPU use). Also the
    hosts' network and disk rates, and how many rented GPUs sit idle (< 10 % for the last
    minute, or no reading at all)."""
    now = timezone.now()
    hosts = list(Host.objects.exclude(state=Host.State.DOWN).order_by("name"))
    ids = [h.pk for h in hosts]
    slots = GpuSlot.objects.filter(host_id__in=ids).values_list(
        "host_id", "index", "node__cluster_id", "node__index", "node__cluster__name"
    )
    cells: dict[int, list[dict]] = {h.pk: [] for h in hosts}
    where: dict[tuple[int, int], list[dict]] = {}  # (cluster, node index) -> its cells
    for host_id, index, cluster_id, node_index, cluster_name in slots.order_by("host", "index"):
        cell = {"index": index, "held": cluster_id is not None, "util": None,
                "cluster": cluster_name or ""}  # fmt: skip
        cells[host_id].append(cell)
        if cluster_id is not None:
            where.setdefault((cluster_id, node_index), []).append(cell)
    nodes = {
        (n.cluster_id, n.index): n
        for n in Node.objects.filter(released_at__isnull=True, host_id__in=ids)
    }
    rates = {h.pk: {"net_bps": 0.0, "disk_bps": 0.0, "iops": 0.0} for h in hosts}
    seen = set()
    recent = Sample.objects.filter(at__gte=now - timedelta(seconds=window_s), host_id__in=ids)
    for s in recent.order_by("-at").values(
        "host_id", "cluster_id", "node_index", "gpu_util", "net_rx_bps", "net_tx_bps",
        "disk_read_bps", "disk_write_bps", "read_iops", "write_iops",
    ):  # fmt: skip
        key = (s["cluster_id"], s["node_index"])
        if key in seen:
            continue  # an older second of a node already read
        seen.add(key)
        node = nodes.get(key)
        if node is not None:
            held = {c["index"]: c for c in where.get(key, [])}
            for index, util in zip(node.gpu_indices, s["gpu_util"] or [], strict=False):
                if index in held:
                    held[index]["util"] = round(util, 1)
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
                "gpus": cells[h.pk],
                "held": sum(1 for c in cells[h.pk] if c["held"]),
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
