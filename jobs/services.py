"""Writes that concern the fleet. Keyword-only, atomic where they span rows."""

from django.db import transaction
from django.utils import timezone

from jobs import engine
from jobs.models import GpuSlot, Host


@transaction.atomic
def host_sync_slots(*, host: Host) -> None:
    """One GPU slot row per GPU of the host, indices 0..gpu_count-1."""
    have = set(host.slots.values_list("index", flat=True))
    want = set(range(host.gpu_count))
    GpuSlot.objects.bulk_create([GpuSlot(host=host, index=i) for i in sorted(want - have)])
    if have - want:
        host.slots.filter(index__in=have - want).delete()


@transaction.atomic
def host_save(*, host: Host) -> Host:
    """Validate and store a host with its slots; nothing is half-saved."""
    host.full_clean()
    host.save()
    host_sync_slots(host=host)
    return host


def host_check(*, host_id: int) -> Host:
    """Ask the host's engine what it is and record the answer (or its error).

    The engine is asked outside any transaction so a slow engine holds no row lock.
    """
    host = Host.objects.get(pk=host_id)
    now = timezone.now()
    try:
        facts = engine.engine_facts(host)
    except engine.EngineError as exc:
        Host.objects.filter(pk=host.pk).update(
            state=Host.State.DOWN, last_checked=now, last_error=str(exc)[:2000]
        )
    else:
        nvidia = facts.pop("nvidia")
        Host.objects.filter(pk=host.pk).update(
            **facts,
            emulated_gpu=not nvidia,
            state=Host.State.DRAINING if host.drain_requested else Host.State.ACTIVE,
            last_checked=now,
            last_seen=now,
            last_error="",
        )
    host.refresh_from_db()
    return host


@transaction.atomic
def host_set_draining(*, host: Host, draining: bool) -> Host:
    """Drain (no new placements; what runs stays) or bring a host back."""
    host = Host.objects.select_for_update().get(pk=host.pk)
    host.drain_requested = draining
    if host.state != Host.State.DOWN:
        host.state = Host.State.DRAINING if draining else Host.State.ACTIVE
    host.save(update_fields=["drain_requested", "state"])
    return host
