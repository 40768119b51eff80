"""Writes that concern hosts: registered, checked (the canary's proofs, jobs/hosts/proofs.py),
drained, and their spot capacity reclaimed. Keyword-only, atomic where they span rows.

Layer: hosts (beside clusters, which it never uses), above nodes and placement: a host back
from an outage gets its nodes back through `slots.replace_node`.
"""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base.text import Text
from jobs.events.lifecycle import cluster_preempt, host_error_fields, request_dispatch

# The lifecycle's host verbs, used through `host_services.` by the console, the watch and the
# admin.
from jobs.events.lifecycle import host_outage_began as host_outage_began
from jobs.events.lifecycle import host_outage_ended as host_outage_ended
from jobs.events.lifecycle import host_unhealthy as host_unhealthy
from jobs.events.lifecycle import request_placement as request_placement
from jobs.events.timeline import cluster_event, reason_passed
from jobs.hosts import proofs
from jobs.models import (
    Cluster,
    GpuSlot,
    Host,
    Node,
)
from jobs.nodes import engine, network
from jobs.placement import catalog, slots, stranded


@transaction.atomic
def host_sync_slots(*, host: Host) -> None:
    """One GPU slot row per GPU of the host, indices 0..gpu_count-1."""
    have = set(host.slots.values_list("index", flat=True))
    want = set(range(host.gpu_count))
    GpuSlot.objects.bulk_create([GpuSlot(host=host, index=i) for i in sorted(want - have)])
    if have - want:
        held = host.slots.filter(index__in=have - want, node__isnull=False).count()
        if held:
            raise ValidationError(
                {
                    "gpu_count": _(
                        "%(held)s of the GPUs to remove are held by clusters; release them or "
                        "drain first."
                    )
                    % {"held": held}
                }
            )
        host.slots.filter(index__in=have - want).delete()
    if want - have:
        request_placement()


@transaction.atomic
def host_save(*, host: Host) -> Host:
    """Validate and store a host with its slots; nothing is half-saved."""
    host.full_clean()
    host.save()
    host_sync_slots(host=host)
    return host


def host_check(*, host_id: int) -> Host:
    """Ask the host's engine what it is, run the canary (jobs/hosts/proofs.py: a container like a
    cluster's that proves the engine starts containers, that they reach neither the host,
    the control plane nor the other hosts, and that the host mounts the console's
    filesystem), prove its swarm and its networks, and record the outcome: active (or
    draining); degraded with the reasons when a proof fails (out of placement), or with the
    engine's words when it answers but cannot run the canary; down when it does not answer.

    The engine is asked outside any transaction so a slow engine holds no row lock.
    A host that left the fleet (`join.sh leave`) is not asked: it is returned as it is.
    """
    host = Host.all_objects.get(pk=host_id)
    if host.state == Host.State.LEFT:
        return host
    try:
        facts = engine.engine_facts(host)
        nvidia = facts.pop("nvidia")
        backing_fs = facts.pop("backing_fs")
        facts["images"] = catalog.on_engine(facts.pop("image_tags"))
        note, reasons = proofs.run(host)
        reasons += proofs.swarm_reasons(host, facts)
        # An engine network over the hosts' own addresses: the engine would route them
        # into a bridge or an overlay, so the host is degraded until the network is gone.
        reasons += network.overlaps(host)
        facts["root_disk_enforced"] = _root_disk_enforced(host, facts["storage_driver"], backing_fs)
    except engine.EngineError as exc:
        return host_unhealthy(host=host, state=Host.State.DOWN, message=str(exc))
    except engine.CanaryFailed as exc:
        Host.objects.filter(pk=host.pk).update(
            **facts, emulated_gpu=not nvidia, last_seen=timezone.now()
        )
        return host_unhealthy(
            host=host, state=Host.State.DEGRADED, message=f"cannot start containers: {exc}"
        )
    if reasons:
        Host.objects.filter(pk=host.pk).update(
            **facts, emulated_gpu=not nvidia, last_seen=timezone.now()
        )
        return host_unhealthy(
            host=host, state=Host.State.DEGRADED, message=proofs.lines([*reasons, note])
        )
    # The time of the outcome, not of the question: accrual may have run meanwhile.
    now = timezone.now()
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host.pk)
        was = host.state
        Host.objects.filter(pk=host.pk).update(
            **facts,
            emulated_gpu=not nvidia,
            state=Host.State.DRAINING if host.drain_requested else Host.State.ACTIVE,
            last_checked=now,
            last_seen=now,
            **host_error_fields(note),
            unhealthy_since=None,
        )
        host_outage_ended(host_id=host.pk, at=now)
        host.refresh_from_db()
    _host_back(host)  # its nodes that were not moved while it was away
    if was != Host.State.ACTIVE and host.state == Host.State.ACTIVE:
        request_placement()  # capacity is back
    return host


def _root_disk_enforced(host: Host, driver: str, backing_fs: str) -> bool:
    """Whether the host's engine limits each container's root filesystem (the system disk,
    runtime.node_container_kwargs); where it does not, the monitor measures it. Tried on
    the engine when the driver may do it and it was not known to (a create with the
    option, never started): the same driver keeps its answer."""
    if not engine.may_size_root_disk(driver, backing_fs):
        return False
    if host.root_disk_enforced and host.storage_driver == driver:
        return True
    return engine.sizes_root_disk(host, settings.SUANLI_CANARY_IMAGE)


def _host_back(host: Host) -> None:
    """A host answers again: its nodes that were not moved meanwhile are placed again on
    it, where they were (a new row each, charged from that second), and their clusters
    hear of it; a cluster whose nodes are all placed again no longer says they wait "to be
    moved". Each under its cluster's lock (placement may be moving the same node)."""
    lost = Node.objects.filter(host=host, released_at__isnull=True, lost_at__isnull=False)
    for cluster_id in set(lost.values_list("cluster_id", flat=True)):
        with transaction.atomic():
            cluster = Cluster.objects.select_for_update().get(pk=cluster_id)
            now = timezone.now()
            back = [
                slots.replace_node(node, host_id=host.pk, now=now, same_slots=True)
                for node in lost.filter(cluster_id=cluster_id)
            ]
            if any(back):
                cluster_event(
                    cluster,
                    "host-back",
                    Text(
                        gettext_noop("host %(host)s is back; charged again from now"),
                        host=host.name,
                    ),
                    at=now,
                )
                request_dispatch(cluster.pk)
            if not Node.objects.filter(
                cluster_id=cluster_id, released_at__isnull=True, lost_at__isnull=False
            ).exists():
                reason_passed(Cluster, cluster_id, stranded.TO_BE_MOVED)


@transaction.atomic
def host_set_draining(*, host: Host, draining: bool) -> Host:
    """Drain (no new placements; what runs stays) or bring a host back. The clusters on an
    active host being drained hear of it (their timeline, and `host.problem` to each owner)."""
    host = Host.objects.select_for_update().get(pk=host.pk)
    if draining and not host.drain_requested and host.state == Host.State.ACTIVE:
        what = Text(
            gettext_noop(
                "host %(host)s is being drained by its operator: what runs there keeps running; "
                "nothing new is placed there"
            ),
            host=host.name,
        )
        for cluster in Cluster.objects.filter(
            node_set__host=host, node_set__released_at__isnull=True
        ).distinct():
            cluster_event(cluster, "host-draining", what)
    host.drain_requested = draining
    if host.state not in Host.UNHEALTHY:  # the next good check sets it from the flag
        host.state = Host.State.DRAINING if draining else Host.State.ACTIVE
    host.save(update_fields=["drain_requested", "state"])
    if host.state == Host.State.ACTIVE:
        request_placement()
    return host


# -- clusters ---------------------------------------------------------------------------


def host_reclaim_spot(*, host: Host, by: str) -> list[Cluster]:
    """The operator takes back a host's spot capacity: every running spot cluster with a
    node on it is preempted (all its nodes: a gang job cannot go on with one missing)."""
    preempted = []
    for cluster in Cluster.objects.filter(
        spot=True,
        state=Cluster.State.RUNNING,
        node_set__host=host,
        node_set__released_at__isnull=True,
    ).distinct():
        if cluster_preempt(
            cluster=cluster,
            reason=Text(
                gettext_noop("spot capacity on %(host)s reclaimed by %(by)s"), host=host.name, by=by
            ),
        ):
            preempted.append(cluster)
    return preempted
