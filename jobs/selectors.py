"""Reads of the fleet that pages and other apps reuse."""

from dataclasses import dataclass

from django.db.models import Count, Q, QuerySet

from jobs.models import Host


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
            free=row["total"],
            total=row["total"],
            hosts=row["hosts"],
            emulated_hosts=row["emulated"],
        )
        for row in rows
    ]


def hosts_with_occupancy() -> QuerySet[Host]:
    return Host.objects.select_related("gpu_model").annotate(slot_total=Count("slots"))
