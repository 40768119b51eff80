"""Reads of the fleet that pages and other apps reuse."""

from dataclasses import dataclass

from django.db.models import Count, Q, QuerySet
from django.http import Http404

from jobs.models import Cluster, Host, Node


@dataclass(frozen=True)
class Availability:
    gpu_model: str
    memory_gb: int
    zone: str
    free: int
    total: int
    hosts: int
    emulated_hosts: int


def fleet_availability() -> list[Availability]:
    """Free GPUs per GPU model and zone, counting only hosts that take new work."""
    rows = (
        Host.objects.filter(state=Host.State.ACTIVE, gpu_model__isnull=False)
        .values("gpu_model__name", "gpu_model__memory_gb", "zone")
        .annotate(
            total=Count("slots"),
            free=Count("slots", filter=Q(slots__node__isnull=True)),
            hosts=Count("id", distinct=True),
            emulated=Count("id", filter=Q(emulated_gpu=True), distinct=True),
        )
        .order_by("gpu_model__memory_gb", "gpu_model__name", "zone")
    )
    return [
        Availability(
            gpu_model=row["gpu_model__name"],
            memory_gb=row["gpu_model__memory_gb"],
            zone=row["zone"],
            free=row["free"],
            total=row["total"],
            hosts=row["hosts"],
            emulated_hosts=row["emulated"],
        )
        for row in rows
    ]


def hosts_with_occupancy() -> QuerySet[Host]:
    return Host.objects.select_related("gpu_model").annotate(
        slot_total=Count("slots", distinct=True),
        slot_held=Count("slots", filter=Q(slots__node__isnull=False), distinct=True),
        node_count=Count("nodes", filter=Q(nodes__released_at__isnull=True), distinct=True),
        # What "reclaim spot capacity" would preempt here.
        spot_nodes=Count(
            "nodes",
            filter=Q(
                nodes__released_at__isnull=True,
                nodes__cluster__spot=True,
                nodes__cluster__state=Cluster.State.RUNNING,
            ),
            distinct=True,
        ),
    )


def gpu_capacity_by_model() -> dict[int, dict]:
    """Per GPU model: free GPUs per zone, the largest host's GPU count, and whether any
    RDMA host offers it. Active hosts only."""
    out: dict[int, dict] = {}
    rows = (
        Host.objects.filter(state=Host.State.ACTIVE, gpu_model__isnull=False)
        .values("gpu_model_id", "zone", "rdma", "gpu_count", "cpu_count", "memory_bytes")
        .annotate(free=Count("slots", filter=Q(slots__node__isnull=True)))
    )
    for row in rows:
        entry = out.setdefault(
            row["gpu_model_id"], {"zones": {}, "largest": 0, "rdma_zones": set()}
        )
        # What one GPU brings with it on the least generous host.
        host = Host(
            gpu_count=row["gpu_count"], cpu_count=row["cpu_count"], memory_bytes=row["memory_bytes"]
        )
        cpus, memory = host.gpu_share(1)
        if row["cpu_count"]:
            entry["cpus_per_gpu"] = min(entry.get("cpus_per_gpu", cpus), cpus)
        if memory:
            gb = memory / 2**30
            entry["memory_gb_per_gpu"] = min(entry.get("memory_gb_per_gpu", gb), gb)
        entry["zones"][row["zone"]] = entry["zones"].get(row["zone"], 0) + row["free"]
        entry["largest"] = max(entry["largest"], row["gpu_count"])
        if row["rdma"]:
            entry["rdma_zones"].add(row["zone"])
    return out


def active_zones() -> list[str]:
    return list(
        Host.objects.filter(state=Host.State.ACTIVE)
        .values_list("zone", flat=True)
        .distinct()
        .order_by("zone")
    )


def rdma_available() -> bool:
    return Host.objects.filter(state=Host.State.ACTIVE, rdma=True).exists()


def clusters_for(user) -> QuerySet[Cluster]:
    return Cluster.objects.filter(owner=user).select_related("gpu_model", "instance_type")


def cluster_for_user(user, cluster_id: int) -> Cluster:
    """The one place that decides who may see a cluster: its owner. Others get 404."""
    try:
        return clusters_for(user).get(pk=cluster_id)
    except Cluster.DoesNotExist:
        raise Http404("No such cluster.") from None


def live_nodes(cluster: Cluster) -> QuerySet[Node]:
    return (
        cluster.node_set.filter(released_at__isnull=True).select_related("host").order_by("index")
    )


def queue() -> list[Cluster]:
    """All pending clusters in placement order."""
    return list(
        Cluster.objects.filter(state=Cluster.State.PENDING)
        .select_related("owner", "gpu_model", "instance_type")
        .order_by("spot", "queued_at", "id")  # as placement walks it: on-demand first
    )


def queue_position(cluster: Cluster) -> int | None:
    if cluster.state != Cluster.State.PENDING:
        return None
    same_class = Q(spot=cluster.spot) & (
        Q(queued_at__lt=cluster.queued_at) | Q(queued_at=cluster.queued_at, id__lt=cluster.id)
    )
    on_demand = Q(spot=False) if cluster.spot else Q(pk__in=[])
    ahead = Cluster.objects.filter(state=Cluster.State.PENDING).filter(same_class | on_demand)
    return ahead.count() + 1


def largest_cpu_host() -> int:
    from django.db.models import Max

    return Host.objects.filter(state=Host.State.ACTIVE).aggregate(m=Max("cpu_count"))["m"] or 0


def jobs_for(user):
    """A researcher's own jobs, newest first."""
    from jobs.models import Job

    return Job.objects.filter(owner=user).order_by("-created_at", "-id")


def job_for_user(user, job_id: int):
    """The job's owner (and operators) may see a job; anyone else gets 404."""
    from jobs.models import Job

    jobs = Job.objects.select_related("cluster", "cluster__gpu_model", "cluster__instance_type")
    if not user.is_staff:
        jobs = jobs.filter(owner=user)
    try:
        return jobs.get(pk=job_id)
    except Job.DoesNotExist:
        raise Http404("No such job.") from None


def split_log_line(line: str) -> tuple[str, str]:
    """Docker's timestamped line -> (timestamp, text)."""
    ts, _, text = line.partition(" ")
    return ts, text


def job_log_lines(job, attempt: int | None = None) -> list[tuple[str, int, str]]:
    """The stored log of every replica of an attempt, merged by time: (ts, rank, text)."""
    lines = []
    for replica in job.replicas.filter(attempt=attempt or job.attempt):
        for raw in replica.log.splitlines():
            ts, text = split_log_line(raw)
            lines.append((ts, replica.rank, text))
    lines.sort(key=lambda item: (item[0], item[1]))
    return lines


def queue_position_of_job(job) -> int | None:
    from jobs.models import Job

    if job.state not in Job.WAITING:
        return None
    return (
        job.cluster.jobs.filter(state__in=Job.WAITING, queued_at__lte=job.queued_at)
        .exclude(pk=job.pk)
        .filter(Q(queued_at__lt=job.queued_at) | Q(id__lt=job.id))
        .count()
        + 1
    )
